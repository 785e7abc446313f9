"""Synchronous in-process engine and the offline ``LLM`` API.

    from bladellm import LLM, SamplingParams
    llm = LLM(model="path/to/model", dtype="bfloat16")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

from tqdm.auto import tqdm

from bladellm.config import EngineConfig
from bladellm.engine.engine_core import EngineCore
from bladellm.engine import embedding
from bladellm.engine.input_processor import InputProcessor
from bladellm.engine.output_processor import OutputProcessor
from bladellm.engine.model_info import model_info_for
from bladellm.lora.request import LoRARequest
from bladellm.checkpoint.pooling_config import pooling_config
from bladellm.outputs import RequestOutput
from bladellm.platforms.threads import apply_engine_omp_policy
from bladellm.sampling_params import SamplingParams

PromptType = str | list[int]


class LLMEngine:
    """Front-end processing + an in-process engine core, stepped by the caller."""

    def __init__(self, config: EngineConfig) -> None:
        # The engine core runs in this process: its OpenMP policy must be set before anything
        # loads torch (a no-op if the caller already imported it; platforms/threads.py).
        apply_engine_omp_policy()
        from bladellm.model.loader import resolve_model  # loads torch: after the policy

        self.config = config
        resolved = resolve_model(config.model, snapshot_config=True, device=config.device)
        self.model_info = model_info_for(resolved)
        self.input_processor = InputProcessor(
            self.model_info, config.guided.guided_max_grammar_size,
            priority_scheduling=config.scheduler.priority_scheduling,
            mm_config=config.multimodal)
        self.output_processor = OutputProcessor(self.model_info.tokenizer)
        self.core = EngineCore(config, resolved)
        self.core.set_eos_token_ids(self.model_info.eos_token_ids)
        self.lora_registry = None
        if config.lora.enable_lora:
            from bladellm.lora.registry import LoRARegistry

            self.lora_registry = LoRARegistry(config.lora, resolved.hf_config)
        self.pooling = pooling_config(resolved.path, resolved.hf_config)

    def default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.model_info.sampling_defaults)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None,
                    lora_request: LoRARequest | None = None, priority: int = 0,
                    images: list | None = None) -> None:
        arrival_time = time.time() if arrival_time is None else arrival_time
        lora_request = self.check_lora(lora_request)
        core_reqs = self.input_processor.process(request_id, prompt, params, arrival_time,
                                                 lora_request=lora_request, priority=priority,
                                                 images=images)
        self.output_processor.add_request(
            request_id, prompt if isinstance(prompt, str) else None,
            core_reqs[0].prompt_token_ids, params, [r.request_id for r in core_reqs],
            arrival_time, delta=False)
        for req in core_reqs:
            self.core.add_request(req)

    def check_lora(self, lora_request: LoRARequest | None) -> LoRARequest | None:
        """The adapter a request runs with, checked like ``LLM.lora_request``'s (a hand-built
        ``LoRARequest(name, id, path)`` included: its config and weight header are read, and
        its id may not stand for another adapter); raises before anything is queued."""
        if lora_request is None:
            return None
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request: must be a LoRARequest or None, "
                            f"got {type(lora_request).__name__}")
        if self.lora_registry is None:
            raise ValueError("lora_request: LoRA is not enabled (enable_lora=True)")
        return self.lora_registry.adopt(lora_request)

    def abort_request(self, request_id: str) -> None:
        self.core.abort_requests(self.output_processor.abort_request(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        outputs = self.core.step()
        processed = self.output_processor.process_outputs(outputs.outputs, time.time())
        if processed.reqs_to_abort:  # stop strings matched: the core stops them now
            self.core.abort_requests(processed.reqs_to_abort)
        return list(processed.request_outputs.values())


class LLM:
    """Offline batched generation. Keyword arguments are engine options (see bladellm.config)."""

    def __init__(self, model: str = "demo", **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))
        self._ids = itertools.count()
        self._shut_down = False

    def _check_open(self) -> None:
        if self._shut_down:
            raise RuntimeError("this LLM was shut down (LLM.shutdown()); create a new LLM")

    def lora_request(self, name: str, path: str) -> LoRARequest:
        """Register (once) and return the adapter in PEFT directory ``path`` under ``name``."""
        self._check_open()
        registry = self.engine.lora_registry
        if registry is None:
            raise ValueError("LoRA is not enabled (enable_lora=True)")
        existing = registry.get(name)
        return existing if existing is not None else registry.add(name, path, trusted=True)

    def get_tokenizer(self):
        return self.engine.model_info.tokenizer

    def shutdown(self) -> None:
        """Stop the engine's worker processes now (tensor parallelism); they also end with
        this process. Later calls raise RuntimeError."""
        if self._shut_down:
            return
        self._shut_down = True
        self.engine.core.shutdown()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: int | Sequence[int] | None = None,
                 ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs in the order of the prompts.
        ``lora_request``: one adapter for all prompts or one (or None) per prompt; build them
        with ``LLM.lora_request(name, path)`` or as ``LoRARequest(name, id, path)`` (id > 0,
        one id per adapter). ``priority``: one for all prompts or one per prompt (vLLM's list),
        lower first; other than 0 only with ``scheduling_policy="priority"``."""
        self._check_open()
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts, images = zip(*[_prompt_and_images(p) for p in prompts]) if prompts else ((), ())
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.engine.default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)) and all(
                isinstance(p, SamplingParams) for p in sampling_params):
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"sampling_params: got a list of {len(params_list)} for "
                                 f"{len(prompts)} prompts; pass one SamplingParams, or one "
                                 f"per prompt")
        else:
            raise TypeError(f"sampling_params: must be a SamplingParams or a list of them "
                            f"(one per prompt), got {_type_name(sampling_params)}")
        loras = (list(lora_request) if isinstance(lora_request, (list, tuple))
                 else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request: got {len(loras)} for {len(prompts)} prompts")
        priorities = (list(priority) if isinstance(priority, (list, tuple))
                      else [0 if priority is None else priority] * len(prompts))
        if len(priorities) != len(prompts):
            raise ValueError(f"priority: got {len(priorities)} for {len(prompts)} prompts")
        # Adapters are checked (and their files read) before any request is queued.
        loras = [self.engine.check_lora(lora) for lora in loras]
        ids = [str(next(self._ids)) for _ in prompts]
        added: list[str] = []
        try:
            for request_id, prompt, params, lora, prio, imgs in zip(
                    ids, prompts, params_list, loras, priorities, images):
                self.engine.add_request(request_id, prompt, params, lora_request=lora,
                                        priority=prio, images=imgs)
                added.append(request_id)
        except Exception:
            # A bad prompt fails the whole call: leave nothing of it in the engine.
            for request_id in added:
                self.engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
             **template_kwargs) -> list[RequestOutput]:
        """Apply the chat template (the model's, or ``chat_template``) to each conversation, then
        generate. ``tools`` are rendered by the template (tool calls in the output are not
        parsed); ``chat_template_kwargs`` (or extra keyword arguments) are template variables.
        The rendered text already holds the special tokens, so none are added again."""
        self._check_open()
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        kwargs = {**(chat_template_kwargs or {}), **template_kwargs}
        if chat_template is not None:
            kwargs["chat_template"] = chat_template
        if tools is not None:
            kwargs["tools"] = tools
        if continue_final_message:
            if add_generation_prompt:
                raise ValueError("continue_final_message and add_generation_prompt cannot "
                                 "both be true")
            kwargs["continue_final_message"] = True
        processor = self.engine.input_processor
        prompts: list = []
        for conv in conversations:
            ids = processor.tokenize(processor.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, **kwargs),
                add_special_tokens=False)
            images = processor.load_chat_images(conv)  # image_url parts (data: URLs)
            prompts.append({"prompt_token_ids": ids, "multi_modal_data": {"image": images}}
                           if images else ids)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def embed(self, prompts: PromptType | dict | Sequence[PromptType | dict],
              dimensions: int | None = None,
              truncate_prompt_tokens: int | None = None) -> list[embedding.EmbeddingOutput]:
        """Embeddings of the prompts: the final hidden states pooled as the model's config says
        (last token by default, mean for sentence-transformers mean pooling), L2-normalized.
        ``truncate_prompt_tokens``: keep the last k tokens of each prompt (-1: max_model_len)."""
        self._check_open()
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        texts = [_prompt_of(p) for p in prompts]  # type: ignore[union-attr]
        engine = self.engine
        embedding.check_dimensions(dimensions, engine.pooling)
        info = engine.model_info
        ids = [embedding.truncate_prompt(engine.input_processor.tokenize(p),
                                         truncate_prompt_tokens, info.max_model_len)
               for p in texts]
        for i, one in enumerate(ids):
            embedding.check_prompt(one, info.max_model_len, info.vocab_size, i)
        vectors = engine.core.embed(ids, engine.pooling.pooling)  # in-process core
        return [embedding.EmbeddingOutput(embedding.finish(v, engine.pooling, dimensions), p)
                for v, p in zip(vectors, ids)]

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", disable=not use_tqdm, unit="req")
        num_out, start = 0, time.perf_counter()
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        num_out += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        bar.set_postfix(out_tok_s=f"{num_out / (time.perf_counter() - start):.1f}")
        except BaseException:
            for request_id in ids:
                if request_id not in finished:
                    self.engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        return [finished[i] for i in ids]


def _type_name(value: object) -> str:
    if isinstance(value, (list, tuple)):
        kinds = sorted({type(v).__name__ for v in value})
        return f"a {type(value).__name__} of {', '.join(kinds) or 'nothing'}"
    return type(value).__name__


def _prompt_and_images(prompt: PromptType | dict) -> tuple[PromptType, list | None]:
    """vLLM's prompt forms, ``multi_modal_data`` included: ``{"prompt": str,
    "multi_modal_data": {"image": PIL.Image | [PIL.Image, ...]}}`` (or ``prompt_token_ids``)."""
    if not isinstance(prompt, dict) or "multi_modal_data" not in prompt:
        return _prompt_of(prompt), None
    rest = {k: v for k, v in prompt.items() if k != "multi_modal_data"}
    data = prompt["multi_modal_data"]
    if not isinstance(data, dict) or set(data) - {"image"}:
        raise ValueError(f"multi_modal_data: must be {{'image': PIL.Image or a list of "
                         f"them}}; got {data if not isinstance(data, dict) else sorted(data)}")
    images = data.get("image")
    images = list(images) if isinstance(images, (list, tuple)) else \
        ([] if images is None else [images])
    return _prompt_of(rest), images


def _prompt_of(prompt: PromptType | dict) -> PromptType:
    """vLLM's prompt forms: a string, token ids, ``{"prompt": str}`` or
    ``{"prompt_token_ids": [...]}``."""
    if not isinstance(prompt, dict):
        return prompt
    keys = set(prompt)
    if keys == {"prompt"} and isinstance(prompt["prompt"], str):
        return prompt["prompt"]
    if keys == {"prompt_token_ids"} and isinstance(prompt["prompt_token_ids"], list):
        return list(prompt["prompt_token_ids"])
    raise ValueError(f"prompt: a dict prompt must be {{'prompt': str}} or "
                     f"{{'prompt_token_ids': [int, ...]}} (with 'multi_modal_data' for "
                     f"images); got keys {sorted(keys)}")
