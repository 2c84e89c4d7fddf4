"""Write a tiny random LoRA adapter for a Llama checkpoint into DIR, in peft's on-disk format (no peft needed).

    .venv-vllm/bin/python -m prefixpool.testing.tiny_lora BASE_DIR OUT_DIR [--rank 8 --seed 1]

    OUT_DIR/adapter_config.json         peft_type LORA, r, lora_alpha, target_modules
    OUT_DIR/adapter_model.safetensors   per layer and target module:
        base_model.model.model.layers.{i}.self_attn.{q,v}_proj.lora_A.weight  (r, in)
        base_model.model.model.layers.{i}.self_attn.{q,v}_proj.lora_B.weight  (out, r)

Both A and B are random (peft starts B at zero, which would make the adapter a no-op), so
the adapter's answers differ from the base model's: a test can tell which one served it.
`vllm serve BASE --enable-lora --lora-modules NAME=OUT_DIR` loads it. Knows nothing of prefixpool.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

TARGETS = ("q_proj", "v_proj")


def adapter_tensors(config: dict, rank: int, scale: float) -> dict[str, torch.Tensor]:
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    out_dims = {"q_proj": config["num_attention_heads"] * head_dim, "v_proj": config["num_key_value_heads"] * head_dim}
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for target in TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_dims[target], rank) * scale
    return tensors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base")
    parser.add_argument("out")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--scale", type=float, default=0.5)
    args = parser.parse_args()
    config = json.loads((Path(args.base) / "config.json").read_text())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    save_file(adapter_tensors(config, args.rank, args.scale), str(out / "adapter_model.safetensors"))
    adapter_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": args.rank, "lora_alpha": 2 * args.rank,
                      "lora_dropout": 0.0, "bias": "none", "target_modules": list(TARGETS),
                      "base_model_name_or_path": str(Path(args.base).resolve()), "fan_in_fan_out": False,
                      "modules_to_save": None, "use_rslora": False, "use_dora": False}
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    print(out)


if __name__ == "__main__":
    main()
