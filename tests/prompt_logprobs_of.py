"""Prompt logprobs of an offline ``LLM`` in the worker's old per-position form, for tests that
compare them: per prompt, per token after the first, ([token, *top ids], [its logprob, *top
logprobs], its rank). They come from the request's own prefill (``max_tokens`` greedy tokens
after it, ignoring EOS)."""

from __future__ import annotations

from bladellm import SamplingParams


def prompt_logprobs_of(llm, prompts: list[list[int]], num_top: int,
                       max_tokens: int = 1) -> list[list[tuple]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, prompt_logprobs=num_top,
                                                temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    return [[([t.token_id for t in entry], [t.logprob for t in entry], entry[0].rank)
             for entry in out.prompt_logprobs[1:]] for out in outs]
