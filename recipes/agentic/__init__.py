"""Agentic tool-use RL in sandboxes: legal-document tasks, file tools, a rubric, a training loop.

`tasks` generates the workspaces, `sandbox` (bubblewrap) and `gke_sandbox`
(agent-sandbox on GKE) run each episode's tool actions in isolation and
`backends` picks between them, `tools` exposes them to the model, `rubric` grades
the deliverable (`judge` optionally asks a model too), `env` wires these into
tinker-cookbook's Env/EnvGroupBuilder/RLDataset, `train` is the loop and `plot`
its curve.
"""
