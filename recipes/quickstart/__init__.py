"""The quickstart: RL-train SmolLM2-135M-Instruct on single-digit addition, on the CPU, via the tinker SDK.

Run `python -m recipes.quickstart --url http://127.0.0.1:8000` after
`openrld serve`; see README.md in this directory.
"""
