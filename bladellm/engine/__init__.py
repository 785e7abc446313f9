"""The engine: two processes, and which module runs where.

API process (asyncio; tokenization, HTTP and detokenization never stall a step):
    async_llm.py         per-request streams, cancellation, backpressure
    core_client.py       starts the engine-core process, ZMQ in/out
    input_processor.py   tokens, length checks -> EngineCoreRequest
    output_processor.py  incremental detokenization, stop strings, logprobs -> RequestOutput
    detokenizer.py, model_info.py, metrics.py

Engine-core process (a busy loop: schedule -> execute -> update -> emit):
    core_proc.py         the process entry point and busy loop
    engine_core.py       EngineCore: core.Scheduler + executor.Executor (-> worker.Worker)

Both: messages.py (the wire structs; error types live in bladellm/errors.py). The offline
``LLM`` (llm_engine.py) runs the front end and an ``EngineCore`` in one process: same code, no
sockets.
"""
