"""Prompt tokens per training episode with a real chat template: SmolLM2 on llama.cpp.

    .venv/bin/python bench/training_real_template.py [--samples 6] [--max-new-tokens 256] [--seed 7]

Plays ``--samples`` rollouts of each of the small catalog's tasks 0 and 2 through
``slime_adapter.generate`` (the test's set-up: ``tests/training/test_real_model.py``), the prompts
rendered by SmolLM2's own tokenizer and template (exported from its GGUF), against the llama.cpp
token endpoint in the LLM cache (``make llm-server``) and the testbed shop. Prints, as JSON: the
prompt tokens sent, what a server would prefill if each call reused the previous call's prompt
and reply (``reused_prefix_tokens``), the share of each later call's prompt that extends the
previous one, the forks, and the tokens the endpoint's own prefix cache served
(docs/benchmarks.md, "Training prompts with a real chat template").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shopsimrl.testbed.gguf_tokenizer import export_hf_tokenizer  # noqa: E402
from shopsimrl.testbed.llm import TokenServer, installed_server  # noqa: E402
from shopsimrl.testbed.serving import running_server  # noqa: E402
from shopsimrl.testbed.shop import ShopSettings, create_app  # noqa: E402
from shopsimrl.training import slime_adapter  # noqa: E402
from shopsimrl.training.config import load_training_config  # noqa: E402
from shopsimrl.training.store import read_training_samples  # noqa: E402
from tests.training.slime_contract import ContractSample, installed  # noqa: E402
from tests.training.test_real_model import PARAMS, RUN_SEED, SMALL_CATALOG, _config, _Recorder  # noqa: E402

TASKS = [0, 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=6, help="rollouts per task")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=7, help="run.seed (episode seeds derive from it)")
    args = parser.parse_args()
    found = installed_server()
    if found is None:
        print("no llama.cpp environment: run `make llm-server` first", file=sys.stderr)
        return 2
    python, model = found
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(scratch)
        tokenizer = export_hf_tokenizer(model, tmp / "tokenizer")
        with (
            TokenServer(model, python=python, n_threads=1) as server,
            running_server(create_app(ShopSettings(slots=2), catalog_path=SMALL_CATALOG)) as shop,
            installed(),
        ):
            recorder = _Recorder(server.base_url)
            with running_server(recorder.app()) as proxy:
                config = _config(tmp, shop, proxy)
                split = {"version": "bench", "splits": {"train": {"task_ids": TASKS, "persona": False, "role": "train"}}}
                (tmp / "split.json").write_text(json.dumps(split), encoding="utf-8")
                config.write_text(config.read_text().replace(f"seed: {RUN_SEED}", f"seed: {args.seed}"), encoding="utf-8")
                slime_args = SimpleNamespace(
                    shopsim_training_config=str(config), hf_checkpoint=str(tokenizer), partial_rollout=False, group_rm=False
                )
                samples = [
                    ContractSample(group_index=g, index=g * args.samples + i, prompt=str(task), metadata={"task_id": task})
                    for g, task in enumerate(TASKS)
                    for i in range(args.samples)
                ]
                params = {**PARAMS, "max_new_tokens": args.max_new_tokens}

                async def play() -> None:
                    try:
                        await asyncio.gather(*(slime_adapter.generate(slime_args, s, dict(params)) for s in samples))
                    finally:
                        await slime_adapter.close_workers()

                started = time.perf_counter()
                asyncio.run(play())
                wall = time.perf_counter() - started
        lines = list(read_training_samples(load_training_config(config).run_dir).records.values())
    sent = sum(sum(line["prompt_tokens"]) for line in lines)
    reused = sum(sum(line["reused_prefix_tokens"]) for line in lines)
    later = [(r, p) for line in lines for r, p in zip(line["reused_prefix_tokens"][1:], line["prompt_tokens"][1:], strict=True)]
    print(
        json.dumps(
            {
                "episodes": len(lines),
                "calls": sum(len(line["prompt_tokens"]) for line in lines),
                "episodes_past_first_call": sum(len(line["prompt_tokens"]) > 1 for line in lines),
                "prompt_tokens_sent": sent,
                "prompt_tokens_per_episode": round(sent / max(1, len(lines)), 1),
                "prefill_if_each_call_reused_the_previous": sent - reused,
                "later_calls_share_extending": [round(r / p, 3) for r, p in later],
                "forks": sum(line["forks"] for line in lines),
                "endpoint_cached_tokens": sum(call["answer"]["meta_info"]["cached_tokens"] for call in recorder.calls),
                "per_episode": [
                    {
                        "episode": line["episode_id"],
                        "prompt_tokens": line["prompt_tokens"],
                        "reused": line["reused_prefix_tokens"],
                    }
                    for line in lines
                ],
                "wall_s": round(wall, 1),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
