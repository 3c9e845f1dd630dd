"""A relational checkpoint published through the local Hub server loads, with the plugin and without it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hub_server import hub_server  # noqa: F401  (fixture)
from transformers import AutoModelForCausalLM

from relational_hf import RelationalConfig, RelationalForCausalLM
from relational_hf.hub import push_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")


def test_relational_checkpoint_round_trip_through_the_hub(hub_server, tmp_path):  # noqa: F811
    config = RelationalConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = RelationalForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "ckpt")
    push_checkpoint(tmp_path / "ckpt", "test-user/tiny-relational")
    ids = torch.randint(0, 61, (2, 7))
    with torch.no_grad():
        expected = model(ids).logits
        loaded = AutoModelForCausalLM.from_pretrained("test-user/tiny-relational").eval()
        assert torch.equal(loaded(ids).logits, expected)
    torch.save({"ids": ids, "logits": expected}, tmp_path / "expected.pt")
    # someone without the plugin: trust_remote_code fetches the code files from the (local) Hub
    script = textwrap.dedent(f"""
        import sys
        sys.modules["relational_hf"] = None
        import torch
        from transformers import AutoModelForCausalLM
        m = AutoModelForCausalLM.from_pretrained("test-user/tiny-relational", trust_remote_code=True).eval()
        exp = torch.load({str(tmp_path / "expected.pt")!r})
        with torch.no_grad():
            print("DIFF", (m(exp["ids"]).logits - exp["logits"]).abs().max().item())
    """)
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.split("DIFF")[-1]) == 0.0
