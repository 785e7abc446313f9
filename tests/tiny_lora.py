"""Random PEFT LoRA adapters for the tiny test models, written with PEFT's own ``save_pretrained``."""

from __future__ import annotations

import os

import torch


def make_adapter(base_dir: str, out_dir: str | os.PathLike, *, r: int, targets: list[str],
                 seed: int, alpha: float = 16.0, use_rslora: bool = False,
                 fan_in_fan_out: bool = False, std: float = 0.15) -> str:
    """A LoRA adapter with random A and B (not PEFT's zero B, so it changes the output)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=use_rslora,
                     fan_in_fan_out=fan_in_fan_out, lora_dropout=0.0, bias="none",
                     task_type="CAUSAL_LM")
    model = get_peft_model(base, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(str(out_dir))
    return str(out_dir)


@torch.no_grad()
def peft_greedy(base_dir: str, adapter_dir: str | None, prompt: list[int],
                max_tokens: int, attn_implementation: str | None = None) -> list[int]:
    """Greedy tokens of transformers (+ PeftModel when ``adapter_dir``), fp32, full forwards.
    ``attn_implementation="eager"`` for Gemma 2 (transformers' SDPA path skips its soft-cap)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        base_dir, dtype=torch.float32, attn_implementation=attn_implementation)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    ids = list(prompt)
    for _ in range(max_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def peft_prompt_logprobs(base_dir: str, adapter_dir: str | None,
                         prompt: list[int]) -> torch.Tensor:
    """[len(prompt), V] fp32 log-softmax of transformers' logits (+ PeftModel when
    ``adapter_dir``): row p is the distribution of token p + 1."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    with torch.no_grad():
        return torch.log_softmax(model.eval()(torch.tensor([prompt])).logits[0].float(), dim=-1)
