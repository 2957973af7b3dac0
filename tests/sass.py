"""SASS of a cubin (cuobjdump and the nvdisasm it runs, from the nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm wheels of the test extra) and the
scoreboard fields of its instructions, for tests that look at how a program was scheduled."""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

_LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\* (0x[0-9a-f]{16}) \*/")
_HIGH = re.compile(r"/\* (0x[0-9a-f]{16}) \*/")


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One instruction and its control fields (Volta and later: the top 23 bits of the 128-bit
    word): the scoreboard its result sets (write barrier; 7: none) and the scoreboards it waits on."""

    address: int
    text: str
    write_barrier: int
    wait_mask: int


def _tool(name: str) -> str:
    """A CUDA binary tool from the test extra's wheels (or PATH); skips where there is none."""
    for root in sys.path:
        for path in glob.glob(os.path.join(root, "nvidia", "cu*", "bin", name)):
            return path
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not found (pip install -e '.[cu13,test]' installs it)")
    return path


def instructions(cubin: bytes) -> list[Instruction]:
    """The cubin's instructions in address order (one kernel per cubin)."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "program.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        env = {**os.environ, "NVDISASM_PATH": os.path.dirname(_tool("nvdisasm"))}
        listing = subprocess.run([_tool("cuobjdump"), "-sass", path], capture_output=True, text=True, check=True,
                                 env=env).stdout
    lines = listing.splitlines()
    result = []
    for i, line in enumerate(lines):
        match = _LINE.match(line)
        if match is None:
            continue
        high = int(_HIGH.search(lines[i + 1]).group(1), 16)
        control = high >> 41
        result.append(Instruction(int(match.group(1), 16), match.group(2), (control >> 5) & 7, (control >> 11) & 63))
    if not result:
        raise AssertionError(f"cuobjdump listed no instructions:\n{listing[:2000]}")
    return result
