"""`minivllm serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn on uvloop) in front
of `AsyncLLM`, with vLLM's endpoints, request fields, error shapes and Prometheus metrics.

    protocol.py     request and response bodies (msgspec)
    errors.py       OpenAI's error shape and status codes
    sampling.py     request fields -> SamplingParams
    logprobs.py     OpenAI's logprobs formats
    streaming.py    SSE, merged streams, cancel-on-disconnect
    completions.py  /v1/completions
    chat.py         /v1/chat/completions
    app.py          the app: routes, API key, stats log task
    serve.py        the `minivllm serve` command
    launch.py       a server in a subprocess, for benchmarks and tests
"""
