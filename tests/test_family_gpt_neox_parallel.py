"""GPT-NeoX with `use_parallel_residual=True` (Pythia's form): x + attn(ln1 x) + mlp(ln2 x). The counted groups are
those of the sequential form plus the exchange of the two output biases (only b_O + b_down reaches the stream); a
random element of them keeps the logits (tests/test_family_gpt_neox.py), and here their dimension equals the orbit
dimension measured numerically."""

from __future__ import annotations

import torch
from family_checks import counted_dimension, measured_orbit_dimension, nonlinear_weights, randomize_gains_and_biases
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from relational_hf.symmetry import redundancy_report


def test_counted_dimension_equals_the_orbit_dimension_measured_numerically_in_parallel_mode():
    """d = 8, one parallel layer, 2 heads of width 4 with 2 rotary coordinates, random gains and biases, matrices at
    unit scale: the Jacobian of the logits has a null space of exactly the counted dimension, 8 of it the parallel
    bias exchange.

    The MLP is 8 wide, not 16 as in the sequential test: in parallel mode the first layer's MLP reads ln2 of the token
    embedding alone, so on a vocabulary of V tokens it is a table of V vectors, seen modulo the all-ones direction
    (every reader centres): V (d - 1) = 224 numbers. At width 16 its parameters beyond its own groups outnumber them
    (296 - 48 = 248) and the table's degenerate directions join the null space (309 measured against 230 counted):
    a property of a 32-token vocabulary, not a symmetry (Pythia's 50k-token table is far larger than its first MLP).
    At width 8 (160 parameters) the table constrains them all."""
    torch.manual_seed(0)
    config = GPTNeoXConfig(
        vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8,
        max_position_embeddings=8, rotary_pct=0.5, use_parallel_residual=True,
    )  # fmt: skip
    model = nonlinear_weights(randomize_gains_and_biases(GPTNeoXForCausalLM(config)))
    assert redundancy_report(model, descriptors=False).by_group["parallel_bias_exchange"] == 8
    nullity, gap = measured_orbit_dimension(model, vocab=32, length=8, rows=16)
    assert gap > 4  # decades between the symmetry directions and the rest
    assert nullity == counted_dimension(model) == 214
