"""Kubernetes as eft-run's host, through a JobSet: what a pod says of the job (pod.py), the
defaults eft-run derives from it (defaults.py), the manifests that set it up (manifests.py)
and their check against the released schemas (schemas.py)."""
