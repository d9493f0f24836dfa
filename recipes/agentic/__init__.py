"""Agentic tool-use RL in sandboxes: legal-document tasks, file tools, a rubric, a training loop.

`tasks` generates the workspaces, `sandbox` (bubblewrap) and `gke_sandbox`
(agent-sandbox on GKE) run each episode's tool actions in isolation, `tools`
exposes them to the model, `rubric` grades the deliverable, `env` wires these
into tinker-cookbook's Env/EnvGroupBuilder/RLDataset, and `train` is the loop.
"""
