"""Expert identity (megatron_pec.megatron.expert_params): names, and pieces of real megatron-core models."""

from __future__ import annotations

import pytest
import torch

from megatron_pec.format.item_names import ExpertId
from megatron_pec.megatron.expert_params import ParamPiece, param_pieces, parse_expert_param_name

pytestmark = pytest.mark.both_releases

# ---------------------------------------------------------------- names


@pytest.mark.parametrize(
    "name, expected",
    [
        # SequentialMLP (local spec)
        ("decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight", ("sequential", 0)),
        ("decoder.layers.11.mlp.experts.local_experts.7.linear_fc2.weight", ("sequential", 7)),
        ("module.module.decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.bias", ("sequential", 3)),
        ("local_experts.12.linear_fc1.bias", ("sequential", 12)),
        # TEGroupedMLP (TE spec, GroupedLinear)
        ("decoder.layers.0.mlp.experts.linear_fc1.weight0", ("te_grouped", 0)),
        ("decoder.layers.5.mlp.experts.linear_fc2.weight15", ("te_grouped", 15)),
        ("decoder.layers.5.mlp.experts.linear_fc1.bias3", ("te_grouped", 3)),
        ("linear_fc2.weight2", ("te_grouped", 2)),
        # legacy GroupedMLP
        ("decoder.layers.0.mlp.experts.weight1", ("grouped", None)),
        ("decoder.layers.0.mlp.experts.weight2", ("grouped", None)),
        ("weight2", ("grouped", None)),
    ],
)
def test_expert_names(name, expected):
    assert parse_expert_param_name(name) == expected


@pytest.mark.parametrize(
    "name",
    [
        "embedding.word_embeddings.weight",
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.0.mlp.linear_fc1.weight",  # dense MLP
        "decoder.layers.0.mlp.router.weight",
        "decoder.layers.0.mlp.router.expert_bias",
        "decoder.layers.0.mlp.shared_experts.linear_fc1.weight",  # shared experts are non-expert state
        "decoder.layers.0.mlp.shared_experts.gate_weight",
        "decoder.layers.0.mlp.shared_experts.weight1",
        "decoder.layers.0.mlp.experts.linear_fc1.weight",  # TE without an index: unknown, not an expert
        "decoder.layers.0.mlp.experts.local_experts.0.linear_fc3.weight",
        "decoder.layers.0.mlp.experts.weight3",
        "linear_fc1.weight",
        "output_layer.weight",
    ],
)
def test_non_expert_names(name):
    assert parse_expert_param_name(name) is None


# ---------------------------------------------------------------- real megatron-core models

NUM_EXPERTS = 4


@pytest.fixture(scope="module")
def model_parallel(tmp_path_factory):
    """torch.distributed (gloo, world size 1) and Megatron's model-parallel groups (1, 1)."""
    pytest.importorskip("megatron.core", reason="megatron-core not installed")
    import torch.distributed as dist
    from megatron.core import parallel_state

    created = not dist.is_initialized()
    if created:
        init_file = tmp_path_factory.mktemp("dist") / "init"
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        pytest.skip("torch.distributed already initialized with world size > 1 in this process")
    mp_created = not parallel_state.model_parallel_is_initialized()
    if mp_created:
        parallel_state.initialize_model_parallel(1, 1)
    yield
    if mp_created:
        parallel_state.destroy_model_parallel()
    if created:
        dist.destroy_process_group()


def build_gpt(grouped_gemm: bool = False, shared_expert_size: int | None = None):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_moe_experts=NUM_EXPERTS,
        moe_router_topk=2, use_cpu_initialization=True, moe_token_dispatcher_type="allgather",
        params_dtype=torch.bfloat16 if grouped_gemm else torch.float32, bf16=grouped_gemm,
        moe_grouped_gemm=grouped_gemm, moe_shared_expert_intermediate_size=shared_expert_size,
        add_bias_linear=shared_expert_size is None,  # shared experts reject biases
    )
    spec = get_gpt_layer_local_spec(num_experts=NUM_EXPERTS, moe_grouped_gemm=grouped_gemm)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=16)


def moe_layers(model):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [m for m in model.modules() if isinstance(m, MoELayer)]


def check_covers_every_element(model, pieces):
    assert list(pieces) == list(model.parameters())
    for param, ps in pieces.items():
        assert ps[0].start == 0 and ps[-1].end == param.numel()
        assert all(a.end == b.start for a, b in zip(ps, ps[1:]))


def test_sequential_mlp(model_parallel):
    model = build_gpt()
    layers = moe_layers(model)
    assert [type(m.experts).__name__ for m in layers] == ["SequentialMLP"] * 2
    assert [m.layer_number for m in layers] == [1, 2]  # global, 1-based

    pieces = param_pieces(model)
    check_covers_every_element(model, pieces)
    by_name = {n: pieces[p] for n, p in model.named_parameters()}
    for layer in (1, 2):
        for e in range(NUM_EXPERTS):
            for leaf in ("linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight", "linear_fc2.bias"):
                name = f"decoder.layers.{layer - 1}.mlp.experts.local_experts.{e}.{leaf}"
                (piece,) = by_name[name]
                assert piece.expert == ExpertId(layer, e)
    experts = {n for n, ps in by_name.items() if ps[0].expert is not None}
    assert all(".mlp.experts.local_experts." in n for n in experts)
    assert len(experts) == 2 * NUM_EXPERTS * 4
    dense = ("decoder.layers.0.mlp.router.weight", "embedding.word_embeddings.weight", "output_layer.weight")
    for name in dense:
        assert by_name[name] == (ParamPiece(None, 0, model.get_parameter(name).numel()),)


def test_shared_experts_are_non_expert_state(model_parallel):
    model = build_gpt(shared_expert_size=64)
    pieces = {n: param_pieces(model)[p] for n, p in model.named_parameters()}
    shared = [n for n in pieces if ".mlp.shared_experts." in n]
    assert shared, "the local spec built no shared experts"
    assert all(pieces[n][0].expert is None and len(pieces[n]) == 1 for n in shared)
    assert sum(ps[0].expert is not None for ps in pieces.values()) == 2 * NUM_EXPERTS * 2  # fc1, fc2; no bias


def test_expert_parallel_rank_and_pipeline_offset_are_used(model_parallel):
    """Global ids come from local_expert_indices and layer_number, whatever the local names say.

    Stands in for EP rank 1 of 2 and a pipeline stage whose first layer is layer 7.
    """
    model = build_gpt()
    for offset, moe in enumerate(moe_layers(model)):
        moe.layer_number = 7 + offset
        moe.local_expert_indices = [4, 5, 6, 7]
    pieces = param_pieces(model)
    first = model.get_parameter("decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight")
    last = model.get_parameter("decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight")
    assert pieces[first][0].expert == ExpertId(7, 4)
    assert pieces[last][0].expert == ExpertId(8, 7)


def test_wrapper_is_unwrapped(model_parallel):
    class Wrapper(torch.nn.Module):  # the shape of Megatron DDP / Float16Module: model in .module
        def __init__(self, module):
            super().__init__()
            self.module = module

    model = build_gpt()
    assert param_pieces(Wrapper(Wrapper(model))) == param_pieces(model)


class GroupedLike(torch.nn.Module):
    """Parameters shaped like legacy GroupedMLP's (which needs the grouped_gemm package to build)."""

    def __init__(self, hidden, ffn, num_local_experts):
        super().__init__()
        self.num_local_experts = num_local_experts
        self.weight1 = torch.nn.Parameter(torch.zeros(hidden, ffn * num_local_experts))
        self.weight2 = torch.nn.Parameter(torch.zeros(ffn * num_local_experts, hidden))


def test_grouped_weights_split_into_contiguous_expert_chunks(model_parallel):
    model = build_gpt()
    for moe in moe_layers(model):
        moe.experts = GroupedLike(32, 128, NUM_EXPERTS)
    moe = moe_layers(model)[1]
    pieces = param_pieces(model)
    check_covers_every_element(model, pieces)
    chunk = 32 * 128
    assert pieces[moe.experts.weight1] == tuple(
        ParamPiece(ExpertId(2, e), e * chunk, (e + 1) * chunk) for e in range(NUM_EXPERTS)
    )
    # The chunks are exactly what GroupedMLP.forward multiplies for each expert.
    w1 = moe.experts.weight1
    for e, piece in enumerate(pieces[w1]):
        assert w1.view(-1)[piece.start:piece.end].data_ptr() == w1.view(NUM_EXPERTS, 32, -1)[e].data_ptr()


def test_real_grouped_mlp(model_parallel):
    grouped_gemm_util = pytest.importorskip("megatron.core.transformer.moe.grouped_gemm_util",
                                            reason="this megatron-core has no legacy GroupedMLP (gone in 0.19)")

    if not grouped_gemm_util.grouped_gemm_is_available():
        pytest.skip("legacy GroupedMLP needs the grouped_gemm package, not installed here")
    model = build_gpt(grouped_gemm=True)
    moe = moe_layers(model)[0]
    assert type(moe.experts).__name__ == "GroupedMLP"
    pieces = param_pieces(model)
    check_covers_every_element(model, pieces)
    size = moe.experts.weight2.numel() // NUM_EXPERTS
    assert pieces[moe.experts.weight2][3] == ParamPiece(ExpertId(1, 3), 3 * size, 4 * size)


def test_unknown_expert_layout_is_rejected(model_parallel):
    model = build_gpt()

    class Unknown(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w_in = torch.nn.Parameter(torch.zeros(4))

    moe_layers(model)[0].experts = Unknown()
    with pytest.raises(ValueError, match=r"MoE layer 1: parameter 'w_in' of Unknown is not in a known"):
        param_pieces(model)


def test_missing_layer_number_is_rejected(model_parallel):
    model = build_gpt()
    moe_layers(model)[0].layer_number = None
    with pytest.raises(ValueError, match="layer_number=None"):
        param_pieces(model)
