"""The baseline of bench/long_attention.py: transformers' own sdpa attention, in a process of its own.

`python bench/_hf_window_step.py TOKENS [padded]` runs one forward+backward of
`_window_model`'s Gemma 3 with transformers' defaults (sdpa) and prints one JSON line. It
never imports openrld.
"""

from __future__ import annotations

import sys

from _window_model import step_report, window_model

if __name__ == "__main__":
    print(step_report(window_model(), int(sys.argv[1]), padded="padded" in sys.argv[2:]), flush=True)
