"""Prometheus metrics: what an agent exports (catalog), counts (board), serves (exposition, server),
and where Prometheus finds it (targets). Stands on the contract alone; the agent feeds it
(``elasticft.agent.metrics``). docs/metrics.md."""
