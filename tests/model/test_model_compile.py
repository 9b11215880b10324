"""Each block family compiles with fullgraph=True: no graph breaks, one graph shared by all blocks of a family."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch._dynamo.utils import counters

from ablate.config.schema import FeatureConfig, MambaScan, MLAIngress, ModelConfig, MoEDispatch, OnOff, RecurrentScan
from ablate.deep_check import block_fwd_bwd
from kernels.dispatch import Dispatcher
from trainers.model import HybridLM

CFG = ModelConfig(d_model=32, n_heads=2, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, q_lora_rank=16,
                  kv_lora_rank=16, n_experts=4, top_k=2, d_expert=16, ssm_d_state=8, ssm_head_dim=8, ssm_chunk=4,
                  vocab_size=64)
BASE = FeatureConfig()
CASES = {
    "A-fused": ("A", replace(BASE, mla_ingress=MLAIngress.fused)),
    "A-unfused-fused_residual": ("A", replace(BASE, fused_residual=OnOff.on)),
    "E-jagged": ("E", replace(BASE, moe_dispatch=MoEDispatch.jagged)),
    "E-padded": ("E", replace(BASE, moe_dispatch=MoEDispatch.padded)),
    "M-chunked": ("M", replace(BASE, mamba_scan=MambaScan.chunked)),
    "M-sequential": ("M", replace(BASE, mamba_scan=MambaScan.sequential)),
    "R-parallel": ("R", replace(BASE, recurrent_scan=RecurrentScan.parallel)),
    "R-sequential": ("R", replace(BASE, recurrent_scan=RecurrentScan.sequential)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_block_family_compiles_fullgraph_without_breaks(case: str) -> None:
    letter, features = CASES[case]
    torch.manual_seed(0)
    model = HybridLM(replace(CFG, pattern=letter * 2), features, Dispatcher(torch.device("cpu")))
    blocks = [block for _, block in model.blocks()]
    gen = torch.Generator().manual_seed(1)
    stream, delta = (torch.randn(2, 8, CFG.d_model, generator=gen) for _ in range(2))

    torch._dynamo.reset()
    counters.clear()
    for block in blocks:
        # force_eager: the fused_residual CPU op is itself a torch.compile'd function; keep it out of the count.
        with torch.compiler.set_stance("force_eager"):
            eager = block_fwd_bwd(block, stream, delta)
        compiled = block_fwd_bwd(torch.compile(block, fullgraph=True, backend="aot_eager"), stream, delta)
        for a, b in zip(compiled, eager):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, "blocks of one family must share one graph"
