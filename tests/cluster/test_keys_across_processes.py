"""Block keys are the same in every process: no per-process hash seed reaches them."""

import subprocess
import sys

from prefixpool.store.keys import Namespace, chain

NS = Namespace("llama-3-8b")


def test_keys_agree_across_processes():
    code = (
        "from prefixpool.store.keys import Namespace, chain;"
        "print(','.join(k.hex() for k in chain(list(range(5000)), Namespace('llama-3-8b'))))"
    )
    outputs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={"PYTHONHASHSEED": seed, "PYTHONPATH": "."}).stdout.strip()
        for seed in ("1", "2")
    }
    assert outputs == {",".join(k.hex() for k in chain(list(range(5000)), NS))}
