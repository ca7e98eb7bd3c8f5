"""The OpenAI-compatible server: the engine seen from the network. Nothing in the engine imports it.

protocol.py     the request and response bodies (pydantic), which /openapi.json publishes
validation.py   what is refused before a request reaches the engine, and OpenAI's error shape
app.py          the FastAPI routes: tokenize, submit, stream server-sent events
responses.py    the response bodies: choices (prompt_index * n + sample), logprobs, echo, usage
engine_loop.py  AsyncEngine: the one thread that steps the engine, and each request's stream
metrics.py      the gauges, counters and histograms of GET /metrics (prometheus_client, vLLM's
names) cli.py          `python -m minicb serve`, and ServerThread (a server on loopback for tests)
loadtest.py     `python -m minicb.serve.loadtest`: a bounded loopback load test
"""
