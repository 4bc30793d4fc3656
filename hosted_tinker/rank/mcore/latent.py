"""DeepSeek-V3's multi-head latent attention (Kimi-K2's: the same architecture) as megatron-core's
``MLASelfAttention``, and its YaRN rotary embedding.

HF's projections map one to one onto megatron's, each an unfused linear layer:

- ``q_a_proj`` -> ``linear_q_down_proj``, ``q_a_layernorm`` -> ``q_layernorm``, ``q_b_proj`` ->
  ``linear_q_up_proj`` (or, without a query rank, ``q_proj`` -> ``linear_q_proj``);
- ``kv_a_proj_with_mqa`` -> ``linear_kv_down_proj`` (``[latent; rotary key]``), ``kv_a_layernorm``
  -> ``kv_layernorm``, ``kv_b_proj`` -> ``linear_kv_up_proj`` (per head ``[key; value]``);
- ``o_proj`` -> ``linear_proj``.

The down projections are whole on every rank (megatron-core's plain ``Linear``, the
"duplicated" layers of its transformer-engine spec): under sequence parallelism each rank
projects its positions, and the rotary key is gathered over the sequence, whose backward sums the
ranks' shares of its gradient. Not megatron's PyTorch spec, whose column-parallel down
projections gather their output over the ranks with a backward that keeps each rank's own share
of the rotary key's gradient, its heads' alone (the attention's input gradient would be wrong
under tp > 1). The up projections and ``q_proj`` are column-parallel, split by heads as HF's rows
are laid out, ``linear_proj`` row-parallel.
megatron rotates the rotary half of each head de-interleaved (even dimensions, then odd), which
is HF's ``rope_interleave``; a checkpoint without it is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class Latent:
    """The widths of one latent attention layer (every layer's the same)."""

    q_rank: int  # q_lora_rank; 0: the query is one projection of the hidden state (q_proj)
    kv_rank: int  # kv_lora_rank
    nope: int  # qk_nope_head_dim: each head's query/key dimensions without rotary embedding
    rope: int  # qk_rope_head_dim: with it (one rotary key shared by the heads)
    v: int  # v_head_dim

    @classmethod
    def read(cls, config: Any, model_path: str) -> Latent:
        """From transformers' ``DeepseekV3Config`` (its defaults for what the file leaves out)."""
        if not config.rope_interleave:
            raise ValueError(
                f"the megatron backend rotates latent attention's rotary dimensions interleaved (rope_interleave); "
                f"{model_path} sets rope_interleave=false"
            )
        if config.attention_bias:
            raise ValueError(f"the megatron backend converts latent attention without biases; {model_path} has them")
        return cls(
            q_rank=config.q_lora_rank or 0,
            kv_rank=config.kv_lora_rank,
            nope=config.qk_nope_head_dim,
            rope=config.qk_rope_head_dim,
            v=config.v_head_dim,
        )

    def config_fields(self, yarn: Yarn | None, rope_theta: float) -> dict[str, Any]:
        """``MLATransformerConfig``'s fields for this attention."""
        fields: dict[str, Any] = dict(
            multi_latent_attention=True,
            q_lora_rank=self.q_rank or None,
            kv_lora_rank=self.kv_rank,
            qk_head_dim=self.nope,
            qk_pos_emb_head_dim=self.rope,
            v_head_dim=self.v,
            rotary_base=rope_theta,
            rope_type="rope",
            rotary_scaling_factor=1.0,  # no YaRN: megatron's softmax scale is then 1 / sqrt(head dim)
            mscale=1.0,
            mscale_all_dim=0.0,
        )
        if yarn is not None:
            fields.update(yarn.config_fields())
        return fields

    def weights(self, hf: Any, layer: int) -> dict[str, Tensor]:
        """This rank's shards of layer ``layer``'s attention, under megatron's names (``hf``: a
        ``convert.HfWeights``)."""
        p, m = f"{hf.prefix}layers.{layer}.self_attn", f"decoder.layers.{layer}.self_attention"
        out = {
            f"{m}.linear_kv_down_proj.weight": hf.full(f"{p}.kv_a_proj_with_mqa.weight"),
            f"{m}.kv_layernorm.weight": hf.full(f"{p}.kv_a_layernorm.weight"),
            f"{m}.linear_kv_up_proj.weight": hf.row_part(f"{p}.kv_b_proj.weight"),
            f"{m}.linear_proj.weight": hf.col_part(f"{p}.o_proj.weight"),
        }
        if self.q_rank:
            out[f"{m}.linear_q_down_proj.weight"] = hf.full(f"{p}.q_a_proj.weight")
            out[f"{m}.q_layernorm.weight"] = hf.full(f"{p}.q_a_layernorm.weight")
            out[f"{m}.linear_q_up_proj.weight"] = hf.row_part(f"{p}.q_b_proj.weight")
        else:
            out[f"{m}.linear_q_proj.weight"] = hf.row_part(f"{p}.q_proj.weight")
        return out

    def projections(self, heads: int, hidden: int) -> list[tuple[str, str, int, int]]:
        """Each projection LoRA wraps, in the HF module's order (PEFT's, in which adapters are
        drawn): (HF name under ``self_attn``, megatron's under ``self_attention``, in, out)."""
        query = (
            [("q_a_proj", "linear_q_down_proj", hidden, self.q_rank), ("q_b_proj", "linear_q_up_proj", self.q_rank, 0)]
            if self.q_rank
            else [("q_proj", "linear_q_proj", hidden, 0)]
        )
        q_out = heads * (self.nope + self.rope)
        return [
            *((hf, mc, n_in, n_out or q_out) for hf, mc, n_in, n_out in query),
            ("kv_a_proj_with_mqa", "linear_kv_down_proj", hidden, self.kv_rank + self.rope),
            ("kv_b_proj", "linear_kv_up_proj", self.kv_rank, heads * (self.nope + self.v)),
            ("o_proj", "linear_proj", heads * self.v, hidden),
        ]


@dataclass(frozen=True)
class Yarn:
    """YaRN's rotary scaling as HF computes it (``_compute_yarn_parameters``), in megatron's
    terms (``YarnRotaryEmbedding``: the same frequency ramp, cos/sin scaled by ``mscale /
    mscale_all_dim``'s ratio, the softmax scale by ``mscale_all_dim``'s square)."""

    factor: float
    original_max_positions: int
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float
    truncate: bool = True  # the correction range rounded to whole dimensions (gpt-oss: not)

    @classmethod
    def read(cls, rope: dict[str, Any], max_positions: int, model_path: str) -> Yarn:
        if rope.get("attention_factor") is not None:
            raise ValueError(
                f"the megatron backend converts YaRN with the attention factor it derives; {model_path} sets "
                "attention_factor"
            )
        original = rope.get("original_max_position_embeddings") or max_positions
        factor = rope.get("factor") or max_positions / original
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale_all_dim and not mscale:
            raise ValueError(
                f"the megatron backend converts YaRN with mscale_all_dim only beside mscale; {model_path} has "
                f"mscale_all_dim={mscale_all_dim} alone"
            )
        if not mscale_all_dim:  # HF then scales cos/sin by get_mscale(factor) whatever mscale, the softmax not
            mscale, mscale_all_dim = 1.0, 0.0
        return cls(
            factor=float(factor),
            original_max_positions=int(original),
            beta_fast=float(rope.get("beta_fast") or 32),
            beta_slow=float(rope.get("beta_slow") or 1),
            mscale=float(mscale or 1.0),
            mscale_all_dim=float(mscale_all_dim),
            truncate=bool(rope.get("truncate", True)),
        )

    def gpt_fields(self) -> dict[str, Any]:
        """The attributes megatron-core's ``GPTModel`` reads for ``position_embedding_type="yarn"``
        (not ``TransformerConfig`` fields: set on the config after it is made)."""
        return dict(
            yarn_rotary_scaling_factor=self.factor,
            yarn_original_max_position_embeddings=self.original_max_positions,
            yarn_beta_fast=self.beta_fast,
            yarn_beta_slow=self.beta_slow,
            yarn_mscale=self.mscale,
            yarn_mscale_all_dim=self.mscale_all_dim,
            yarn_correction_range_round_to_int=self.truncate,
        )

    def config_fields(self) -> dict[str, Any]:
        """``MLATransformerConfig``'s YaRN fields (its rotary embedding always truncates)."""
        return dict(
            rope_type="yarn",
            rotary_scaling_factor=self.factor,
            original_max_position_embeddings=self.original_max_positions,
            beta_fast=self.beta_fast,
            beta_slow=self.beta_slow,
            mscale=self.mscale,
            mscale_all_dim=self.mscale_all_dim,
        )
