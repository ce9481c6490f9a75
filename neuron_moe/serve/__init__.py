"""`neuron-moe serve`: an OpenAI-compatible HTTP server over one model.

engine.py     the engine: a request's limits checked, continuous batching, one step loop over the
              rows of any runtime
decoding.py   what a request asks and how its tokens become text (sampling parameters, stop
              sequences, held-back text, logprobs), and its Steps as choices: n/best_of, beam search
hf_runtime.py transformers' model as a runtime (the CPU experts backends): a cache per row
chat.py       messages -> prompt ids (the tokenizer's chat template, or a documented fallback)
neuron.py     the Neuron runtime (a compiled NxD artifact; needs the Neuron SDK)
protocol.py   request bodies (OpenAI's schema, strictly) and OpenAI-shaped errors
scheduler.py  bounded admission: a bounded wait queue before the engine's rows; each request's
              latencies counted for /metrics
metrics.py    /metrics in Prometheus' text format, vLLM's names
app.py        the FastAPI routes, SSE streaming, readiness while the model loads
server.py     argument checks, artifact resolution, uvicorn with SIGTERM draining
"""
