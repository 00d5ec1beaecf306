"""A replica serves a package's LoRA adapters: `"model": "NAME:ADAPTER"` picks one, in the same batches as the base
model, with the engine's own outputs; an unknown adapter is a 404 naming the ones there are."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import httpx
import peft
import torch
import transformers

from ember_platform import LLM, SamplingParams
from ember_platform.replica.app import create_app
from ember_platform.replica.core import Replica

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-llama"
PROMPT = [5, 17, 99, 260, 33, 12, 7, 400]


def package_with_adapter(root: Path) -> Path:
    pkg = root / "pkg"
    shutil.copytree(EXAMPLE, pkg, ignore=shutil.ignore_patterns("__pycache__", "ember.lock"))
    base = transformers.AutoModelForCausalLM.from_pretrained(pkg / "weights")
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    model.save_pretrained(pkg / "adapters" / "sql")
    with open(pkg / "ember.toml", "a") as f:
        f.write('\n[[lora]]\nname = "sql"\npath = "adapters/sql"\n')
    return pkg


def test_adapter_requests_and_base_requests_through_the_replica(tmp_path: Path) -> None:
    pkg = package_with_adapter(tmp_path)
    llm = LLM(pkg)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected_base = llm.generate([PROMPT], params)[0].token_ids
    expected_sql = llm.generate([PROMPT], params, lora_name="sql")[0].token_ids
    assert expected_sql != expected_base  # the adapter changes the output

    replica = Replica(pkg)
    replica.load()

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(replica)),
                                     base_url="http://replica", timeout=120) as client:
            body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            base, sql, missing = await asyncio.gather(
                client.post("/v1/completions", json={**body, "model": "tiny-llama"}),
                client.post("/v1/completions", json={**body, "model": "tiny-llama:sql"}),
                client.post("/v1/completions", json={**body, "model": "tiny-llama:nope"}))
            assert base.status_code == 200 and sql.status_code == 200, (base.text, sql.text)
            texts = [r.json()["choices"][0]["text"] for r in (base, sql)]
            assert texts == [llm.engine.tokenizer.decode(expected_base), llm.engine.tokenizer.decode(expected_sql)]
            assert missing.status_code == 404
            error = missing.json()["error"]
            assert error["param"] == "model" and "'nope'" in error["message"] and "sql" in error["message"]

    try:
        asyncio.run(main())
    finally:
        replica.close()
