"""`exactrl.ops.use_deterministic_algorithms`: torch's switch without loading TorchInductor into a process that has
not (torch's own function imports `torch._inductor.config` to set its `deterministic` flag: a second or so at every
process start). In a fresh interpreter: torch's flags are what torch's function sets, inductor is not loaded, and
when it loads later its flag is the one torch's function would have set, both ways."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r"""
import json, sys
import torch
from exactrl.ops import use_deterministic_algorithms
out = {"loaded_before": "torch._inductor.config" in sys.modules}
use_deterministic_algorithms(True, warn_only=True)
out["on"] = [torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()]
out["loaded_after"] = "torch._inductor.config" in sys.modules
import torch._inductor.config as inductor_config
out["inductor_on"] = inductor_config.deterministic
use_deterministic_algorithms(False)  # inductor loaded now: torch's own function
out["off"] = [torch.are_deterministic_algorithms_enabled(), inductor_config.deterministic]
print(json.dumps(out))
"""


def test_the_switch_sets_torchs_flags_without_loading_inductor_and_inductor_sees_them():
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out == {
        "loaded_before": False,
        "on": [True, True],
        "loaded_after": False,
        "inductor_on": True,
        "off": [False, False],
    }
