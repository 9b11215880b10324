"""HybridLM: the A/M/E/R pattern language model that every ablation trial trains.

How to use::

    from trainers.model import HybridLM
    model = HybridLM(lane.model, lane.features, Dispatcher(device))    # typed configs, never dicts
    out = model(tokens_BT, targets_BT)                                # out.loss, out.lm_loss, out.aux_loss, ...
    model.backend_table()      # what each op resolved to (for the receipt)
    for letter, block in model.blocks(): block.compile(fullgraph=True)  # regional compile, one graph per family

Each feature toggle becomes one dispatcher resolution at construction (never per step): ``moe_dispatch`` -> op
``moe``, ``mla_ingress`` -> ``mla_ingress``, ``fused_residual`` -> ``add_rmsnorm`` (off: ``eager``; on: ``triton``
on CUDA, ``compiled`` elsewhere, which a dispatcher built with a regional or whole ``compile_posture`` records and
runs as ``eager``), ``mamba_scan`` -> ``ssd``, ``recurrent_scan`` -> ``recurrent_scan``. Ops of families absent
from the pattern are not resolved (the toggle is inert there; ``layer_counts`` says so).

Losses: ``loss = lm_loss + aux_loss + stp_weight * stp_loss``; ``aux_loss`` = aux_loss_weight * sum over E layers
of the Switch load-balancing loss; ``stp_loss`` (skip-token prediction, ``stp: on``) is cross-entropy of a small
head on the final hidden state predicting token t+2, i.e. ``targets[:, t+1]``.

Shape suffix legend: B batch, T sequence, D d_model, V vocab, E experts, Le number of E layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ablate.config.backends import requested_backends
from ablate.config.schema import FeatureConfig, ModelConfig, OnOff, Precision
from kernels.dispatch import Dispatcher, Resolved
from trainers.model.blocks import Mamba2Block, MLABlock, MoEBlock, RecurrentBlock, ResidualNorm
from ablate.config.pattern import FAMILIES, family_counts, parse_pattern


@dataclass
class LMOutput:
    loss: Tensor
    lm_loss: Tensor
    aux_loss: Tensor
    stp_loss: Optional[Tensor]
    """None when stp is off."""
    tokens_per_expert: Optional[Tensor]
    """(Le, E) int64 routed rows per expert per E layer, before capacity drops; None without E layers."""
    dropped_tokens: Tensor
    """int64 scalar: routed (token, expert) rows dropped by padded capacity, summed over E layers (0 when dropless)."""
    routed_rows: int
    """Routed (token, expert) rows over all E layers this step: T * top_k * Le; the denominator of the drop rate."""


def _resolve_kernels(cfg: ModelConfig, features: FeatureConfig, dispatcher: Dispatcher,
                     precision: Precision) -> dict[str, Resolved]:
    """One resolution per op used by this pattern; each carries its requested/observed/why record."""
    requested = requested_backends(cfg, features, dispatcher.capability.cuda_available)
    context = {"moe": {"dims": (cfg.d_model, cfg.d_expert, 2 * cfg.d_expert), "precision": precision.value},
               "ssd": {"conv_channels": cfg.ssm_expand * cfg.d_model + 2 * cfg.ssm_d_state}}
    return {op: dispatcher.resolve(op, backend, **context.get(op, {})) for op, (_, backend) in requested.items()}


class HybridLM(nn.Module):
    def __init__(self, model_cfg: ModelConfig, features: FeatureConfig, dispatcher: Optional[Dispatcher] = None,
                 precision: Precision = Precision.fp32):
        """``precision``: the lane's (``fp32`` or ``bf16`` autocast); a kernel that computes in another dtype than
        the lane's is not eligible."""
        super().__init__()
        self.cfg, self.features = model_cfg, features
        self.letters = parse_pattern(model_cfg.pattern)
        dispatcher = dispatcher if dispatcher is not None else Dispatcher(torch.device("cpu"))
        resolved = _resolve_kernels(model_cfg, features, dispatcher, precision)
        self._records = [resolved[op].record for op in sorted(resolved)]
        fns = {op: r.fn for op, r in resolved.items()}
        norm = fns["add_rmsnorm"]
        d = model_cfg.d_model

        self.embed = nn.Embedding(model_cfg.vocab_size, d)
        builders: dict[str, Callable[[], nn.Module]] = {
            "A": lambda: MLABlock(model_cfg, norm, fns["mla_ingress"]),
            "E": lambda: MoEBlock(model_cfg, norm, fns["moe"]),
            "M": lambda: Mamba2Block(model_cfg, norm, fns["ssd"]),
            "R": lambda: RecurrentBlock(model_cfg, norm, fns["recurrent_scan"]),
        }
        self.layers = nn.ModuleList([builders[letter]() for letter in self.letters])
        self.final_norm = ResidualNorm(d, model_cfg.norm_eps, norm)
        self.lm_head = nn.Linear(d, model_cfg.vocab_size, bias=False)
        self.stp_head = nn.Linear(d, d, bias=False) if features.stp is OnOff.on else None
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.lm_head.weight, std=0.02)

    def forward(self, tokens_BT: Tensor, targets_BT: Tensor) -> LMOutput:
        x_BTD = self.embed(tokens_BT)
        # The first layer's pending delta is the embedding itself: stream = 0 + x is exact.
        stream_BTD, delta_BTD = torch.zeros_like(x_BTD), x_BTD
        aux_terms: list[Tensor] = []
        expert_loads: list[Tensor] = []
        dropped = torch.zeros((), dtype=torch.long, device=tokens_BT.device)
        for letter, block in zip(self.letters, self.layers):
            if letter == "E":
                stream_BTD, delta_BTD, aux, counts_E, num_dropped = block(stream_BTD, delta_BTD)
                aux_terms.append(aux)
                expert_loads.append(counts_E)
                dropped = dropped + num_dropped
            else:
                stream_BTD, delta_BTD = block(stream_BTD, delta_BTD)
        h_BTD, _ = self.final_norm(stream_BTD, delta_BTD)

        vocab = self.cfg.vocab_size
        lm_loss = F.cross_entropy(self.lm_head(h_BTD).float().view(-1, vocab), targets_BT.reshape(-1))
        aux_loss = self.cfg.aux_loss_weight * torch.stack(aux_terms).sum() if aux_terms else lm_loss.new_zeros(())
        loss = lm_loss + aux_loss
        stp_loss: Optional[Tensor] = None
        if self.stp_head is not None:
            # Position t predicts token t+2 = targets[t+1]; the last position has no such target.
            stp_logits = self.lm_head(self.stp_head(h_BTD[:, :-1])).float()
            stp_loss = F.cross_entropy(stp_logits.reshape(-1, vocab), targets_BT[:, 1:].reshape(-1))
            loss = loss + self.features.stp_weight * stp_loss
        return LMOutput(
            loss=loss, lm_loss=lm_loss, aux_loss=aux_loss, stp_loss=stp_loss,
            tokens_per_expert=torch.stack(expert_loads) if expert_loads else None,
            dropped_tokens=dropped,
            routed_rows=tokens_BT.numel() * self.cfg.top_k * len(expert_loads),
        )

    def blocks(self) -> Iterator[tuple[str, nn.Module]]:
        """(letter, block) per layer, in order: the units of regional compile."""
        return zip(self.letters, self.layers)

    def family_modules(self) -> dict[str, list[nn.Module]]:
        """Family letter -> its blocks, for families present in the pattern (in A, M, E, R order)."""
        out: dict[str, list[nn.Module]] = {}
        for family in FAMILIES:
            members = [block for letter, block in self.blocks() if letter == family]
            if members:
                out[family] = members
        return out

    def layer_counts(self) -> dict[str, int]:
        """Layers per family, all four keys (0 = the family's toggle is inert in this lane)."""
        return family_counts(self.letters)

    def param_counts(self) -> dict[str, int]:
        """total; active per token (routed experts count top_k/n_experts of their weights); embedding (input
        embedding + output head); routed_experts (all routed expert weights)."""
        total = sum(p.numel() for p in self.parameters())
        routed = sum(block.w13.numel() + block.w2.numel() for block in self.layers if isinstance(block, MoEBlock))
        # Routed weights split evenly over experts, so routed * top_k / n_experts is an exact integer.
        routed_active = routed * self.cfg.top_k // self.cfg.n_experts
        embedding = self.embed.weight.numel() + self.lm_head.weight.numel()
        return {"total": total, "active": total - routed + routed_active, "embedding": embedding,
                "routed_experts": routed}

    def backend_table(self) -> list[dict[str, str]]:
        """One row per op this model resolved (requested, observed, reason): what the receipt stores."""
        return [record.as_dict() for record in self._records]
