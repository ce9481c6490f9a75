"""What the static graphs cost per call on the host it runs on, the ceiling of the batching engine.

The batching engine (`serve/batching.py`) spends its time in two calls of the runtime: a prefill
of up to R prompts (the largest of `--prefill-rows`) and a decode step of every row. This times
both at each batch size on the port's static graphs as the server runs them (`serve --backend
static`: `static_runtime`, modules on CPU, greedy rows: the sampler runs in every graph call), and
from them the throughput ratio a perfect engine would reach for requests of `--max-tokens` tokens
against batch 1:

    ratio = B · (P_1 + (n−1)·D_1) / ((B/R)·P_R + (n−1)·D_B)

(every request: its share of a prefill call of R prompts, P_R, then n−1 decode steps; at batch B
the steps are shared by B rows; at batch 1, R = 1).
`bench/serve_load.py` measures what the server reaches through HTTP; this says what the graphs allow.

    OMP_NUM_THREADS=1 python -m bench.static_steps --batch-sizes 1,8 --max-tokens 16 --prefill-rows 4
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

from neuron_moe.model import build_model
from neuron_moe.port import load_port
from neuron_moe.report import table, write_json
from neuron_moe.serve.runtime import static_runtime
from neuron_moe.static.rows import Chunk
from neuron_moe.static.sampling import GREEDY


def best_ms(call, repeats: int) -> float:
    """The fastest of `repeats` calls, in ms (the least disturbed by anything else on the machine)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-gemma4-moe", help="port with a [static] table (default tiny-gemma4-moe)")
    ap.add_argument("--batch-sizes", default="1,8", help="comma-separated; the first is the baseline (default 1,8)")
    ap.add_argument(
        "--prompt-tokens", type=int, default=25, help="prompt length (default 25: the chat prompts' middle)"
    )
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens per request for the ratio (default 16)")
    ap.add_argument("--prefill-rows", type=int, default=4, help="prompts a prefill call takes at batch > 1 (default 4)")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    port = load_port(args.model)
    spec = port.static_spec("bench/static_steps.py")
    model = build_model(port, spec.decode_experts)
    prompt = list(range(5, 5 + args.prompt_tokens))
    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        together = min(args.prefill_rows, batch)
        runtime = static_runtime(model, spec, batch, prefill_rows=(1, together))
        chunks = [Chunk(prompt, 0, row, GREEDY) for row in range(together)]
        runtime.prefill(chunks)
        ids = torch.full((batch, 1), 7)
        positions = torch.full((batch, 1), args.prompt_tokens)
        sampling = torch.tensor([GREEDY] * batch)
        runtime.decode(ids, positions, sampling)  # warm
        rows.append(
            {
                "batch": batch,
                "prefill_rows": together,
                "prefill_ms": best_ms(lambda: runtime.prefill(chunks), args.repeats),
                "decode_ms": best_ms(lambda: runtime.decode(ids, positions, sampling), args.repeats),
            }
        )
    base, n = rows[0], args.max_tokens
    for r in rows:
        r["prefill_ms_per_prompt"] = r["prefill_ms"] / r["prefill_rows"]
        r["decode_ms_per_token"] = r["decode_ms"] / r["batch"]
        r["decode_x_base"] = r["decode_ms"] / base["decode_ms"]
        alone = base["prefill_ms_per_prompt"] + (n - 1) * base["decode_ms"] / base["batch"]
        r["ceiling_x_base"] = r["batch"] * alone / (r["batch"] * r["prefill_ms_per_prompt"] + (n - 1) * r["decode_ms"])
    print(
        f"static graphs of {port.name} (prefill: {spec.prefill_experts}, decode: {spec.decode_experts}), "
        f"prompt {args.prompt_tokens} tokens, {n}-token requests; best of {args.repeats}"
    )
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f}, torch threads {torch.get_num_threads()}\n"
    )
    print(
        table(
            rows,
            [
                ("batch", "batch"),
                ("prefill_rows", "prompts per prefill"),
                ("prefill_ms", "prefill ms", "{:.2f}"),
                ("prefill_ms_per_prompt", "prefill ms/prompt", "{:.2f}"),
                ("decode_ms", "decode step ms", "{:.2f}"),
                ("decode_ms_per_token", "decode ms/token", "{:.2f}"),
                ("decode_x_base", "step × base", "{:.2f}"),
                ("ceiling_x_base", "tok/s ceiling × base", "{:.2f}"),
            ],
        )
    )
    if args.json:
        write_json({"model": port.name, "settings": vars(args), "rows": rows}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
