"""The restart toy's model builder, beside it (as NVIDIA's ``gpt_builders.py`` is beside
``pretrain_gpt.py``): a module of the script's own that imports megatron-core."""

import megatron.core  # the import a real job pays for at every restart
from megatron.core.models.gpt import GPTModel


def build() -> type:
    assert megatron.core.__version__
    return GPTModel
