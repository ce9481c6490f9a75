"""`neuron-moe serve`: an OpenAI-compatible HTTP server over one model.

engine.py     generation over a backend: sampling, stop sequences, token-by-token text
chat.py       messages -> prompt ids (the tokenizer's chat template, or a documented fallback)
neuron.py     the Neuron backend (a compiled NxD artifact; needs the Neuron SDK)
protocol.py   request bodies and OpenAI-shaped errors
scheduler.py  bounded admission: a few generation threads and a bounded wait queue
app.py        the FastAPI routes, SSE streaming, readiness while the model loads
server.py     argument checks, artifact resolution, uvicorn with SIGTERM draining
"""
