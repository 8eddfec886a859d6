"""Single-process tests of the GPT stage chunks: composition, initialisation, loss."""

import pytest
import torch
import torch.nn.functional as F

from ppctl.model.gpt.rules import gpt_rule
from ppctl.model.rules import dense_to_tp_shard, rule_of
from ppctl.model.gpt.model import GPTChunk, GPTConfig
from ppctl.model.layers import apply_rotary, rotary_cos_sin
from ppctl.parallel.groups import RankGroups
from ppctl.parallel.layout import StageLayers
from ppctl.parallel.tensor_parallel import TPGroup, vocab_parallel_cross_entropy

SEED = 1234
BATCH, SEQ = 2, 16


def make_config(**overrides) -> GPTConfig:
    fields = dict(num_layers=3, hidden_size=32, num_heads=4, ffn_hidden_size=64, vocab_size=96, max_seq_length=SEQ)
    fields.update(overrides)
    return GPTConfig(**fields)


def make_batch(config: GPTConfig, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=generator)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    return tokens, positions, labels


def build_chunks(config: GPTConfig, layer_groups, dtype=torch.float32, seed=SEED):
    """Build the chunks of one model, one per entry of ``layer_groups``."""
    last = len(layer_groups) - 1
    return [GPTChunk(config, StageLayers(index, tuple(ids), index == 0, index == last), seed=seed, dtype=dtype)
            for index, ids in enumerate(layer_groups)]


def run_pipeline(chunks, tokens, positions, labels):
    """Run the chunks in sequence, backward through all; return the per-token losses."""
    hidden = tokens
    for chunk in chunks[:-1]:
        hidden = chunk(hidden, positions)
    losses = chunks[-1](hidden, positions, labels)
    weights = torch.linspace(0.5, 1.5, losses.numel(), dtype=losses.dtype).view_as(losses)
    (losses * weights).sum().backward()
    return losses.detach()


def summed_gradients(chunks) -> dict[str, torch.Tensor]:
    """Gradients by global name; a tied output layer's gradient is added to the word embedding's."""
    grads: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if name == "output_layer.weight" and chunk.config.tie_embeddings:
                name = "embedding.word.weight"
            grads[name] = grads[name] + param.grad if name in grads else param.grad.clone()
    return grads


@pytest.mark.parametrize("position_embedding", ["learned", "rope"])
@pytest.mark.parametrize("tie_embeddings", [False, True])
@pytest.mark.parametrize("layer_groups", [[[0], [1, 2]], [[0], [1], [2]], [[], [0, 1, 2], []]])
def test_chunks_in_sequence_match_one_chunk(position_embedding, tie_embeddings, layer_groups):
    config = make_config(position_embedding=position_embedding, tie_embeddings=tie_embeddings)
    tokens, positions, labels = make_batch(config)
    full = build_chunks(config, [[0, 1, 2]])
    split = build_chunks(config, layer_groups)

    full_losses = run_pipeline(full, tokens, positions, labels)
    split_losses = run_pipeline(split, tokens, positions, labels)

    torch.testing.assert_close(split_losses, full_losses, rtol=1e-6, atol=1e-6)
    full_grads, split_grads = summed_gradients(full), summed_gradients(split)
    assert sorted(split_grads) == sorted(full_grads)
    for name, grad in full_grads.items():
        torch.testing.assert_close(split_grads[name], grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_chunk_composition_float64_is_tight():
    config = make_config(position_embedding="rope")
    tokens, positions, labels = make_batch(config)
    full = build_chunks(config, [[0, 1, 2]], dtype=torch.float64)
    split = build_chunks(config, [[0, 1], [2]], dtype=torch.float64)
    torch.testing.assert_close(run_pipeline(split, tokens, positions, labels),
                               run_pipeline(full, tokens, positions, labels), rtol=1e-12, atol=1e-12)
    full_grads, split_grads = summed_gradients(full), summed_gradients(split)
    for name, grad in full_grads.items():
        torch.testing.assert_close(split_grads[name], grad, rtol=1e-10, atol=1e-13)


def test_parameter_names_are_layout_independent():
    config = make_config(tie_embeddings=True)
    full_names = {name for name, _ in build_chunks(config, [[0, 1, 2]])[0].named_parameters()}
    split_names = {name for chunk in build_chunks(config, [[0], [1], [2]]) for name, _ in chunk.named_parameters()}
    assert split_names == full_names | {"output_layer.weight"}
    assert "layers.2.attention.qkv.weight" in full_names


def test_build_twice_is_identical_and_seeds_differ():
    config = make_config()
    first, second = build_chunks(config, [[0, 1, 2]])[0], build_chunks(config, [[0, 1, 2]])[0]
    other_seed = build_chunks(config, [[0, 1, 2]], seed=SEED + 1)[0]
    for (name, param), (_, again), (_, other) in zip(first.named_parameters(), second.named_parameters(),
                                                     other_seed.named_parameters()):
        assert torch.equal(param, again), name
        if gpt_rule(name).init.endswith("normal"):
            assert not torch.equal(param, other), name


def test_layers_with_the_same_role_get_different_values():
    chunk = build_chunks(make_config(), [[0, 1, 2]])[0]
    assert not torch.equal(chunk.layers["0"].mlp.fc_in.weight, chunk.layers["1"].mlp.fc_in.weight)
    qkv = chunk.layers["0"].attention.qkv.weight
    hidden = chunk.config.hidden_size
    assert not torch.equal(qkv[:hidden], qkv[hidden:2 * hidden])


def test_init_statistics():
    config = make_config(hidden_size=64, ffn_hidden_size=256, vocab_size=512)
    chunk = build_chunks(config, [[0, 1, 2]])[0]
    assert torch.equal(chunk.layers["1"].attn_norm.weight, torch.ones(64))
    assert torch.equal(chunk.layers["1"].mlp.fc_in.bias, torch.zeros(256))
    assert abs(chunk.embedding.word.weight.std().item() - 0.02) < 0.002
    scaled_std = 0.02 / (2 * config.num_layers) ** 0.5
    assert abs(chunk.layers["0"].mlp.fc_out.weight.std().item() - scaled_std) < 0.1 * scaled_std


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tp_shards_are_slices_of_the_dense_model(tp_size):
    """Building a chunk needs no communication, so every TP rank's shard can be checked here."""
    config = make_config(position_embedding="learned", tie_embeddings=True)
    dense = dict(build_chunks(config, [[0], [1, 2]])[1].named_parameters())
    dense.update(build_chunks(config, [[0], [1, 2]])[0].named_parameters())
    hidden, heads_per_rank = config.hidden_size, config.num_heads // tp_size
    for tp_rank in range(tp_size):
        tp = TPGroup(group=None, size=tp_size, rank=tp_rank)
        first, last = StageLayers(0, (0,), True, False), StageLayers(1, (1, 2), False, True)
        shards = dict(GPTChunk(config, first, RankGroups(tp=tp), seed=SEED).named_parameters())
        shards.update(GPTChunk(config, last, RankGroups(tp=tp), seed=SEED).named_parameters())
        assert sorted(shards) == sorted(dense)
        for name, shard in shards.items():
            torch.testing.assert_close(shard, dense_to_tp_shard(rule_of(shard), dense[name], tp), rtol=0, atol=0)
        # The fused QKV follows heads: rank r's query rows are rows of heads [r*h, (r+1)*h) of the dense query.
        query_rows = hidden // tp_size
        local_query = shards["layers.1.attention.qkv.weight"][:query_rows]
        dense_query = dense["layers.1.attention.qkv.weight"][:hidden]
        start = tp_rank * heads_per_rank * config.head_dim
        assert torch.equal(local_query, dense_query[start:start + query_rows])


def test_tied_output_layer_starts_equal_to_embedding():
    config = make_config(tie_embeddings=True)
    first, last = build_chunks(config, [[0], [1, 2]])
    assert torch.equal(first.embedding_weight_for_tying(), last.embedding_weight_for_tying())
    assert last.embedding_weight_for_tying() is last.output_layer.weight
    untied_first, untied_last = build_chunks(make_config(), [[0], [1, 2]])
    assert untied_first.embedding_weight_for_tying() is None and untied_last.embedding_weight_for_tying() is None
    assert not torch.equal(untied_first.embedding.word.weight, untied_last.output_layer.weight)


def test_single_chunk_tie_shares_the_weight():
    config = make_config(tie_embeddings=True)
    chunk = build_chunks(config, [[0, 1, 2]])[0]
    assert not hasattr(chunk, "output_layer") or chunk.output_layer is None
    tokens, positions, _ = make_batch(config)
    logits = chunk(tokens, positions)
    expected = F.linear(chunk.final_norm(_hidden_before_head(chunk, tokens, positions)), chunk.embedding.word.weight)
    torch.testing.assert_close(logits, expected)
    assert chunk.embedding_weight_for_tying() is chunk.embedding.word.weight


def _hidden_before_head(chunk, tokens, positions):
    without_head = GPTChunk(chunk.config, StageLayers(0, tuple(chunk.layer_ids), True, False), seed=SEED)
    return without_head(tokens, positions)


@pytest.mark.parametrize("position_embedding", ["learned", "rope"])
def test_loss_matches_torch_cross_entropy(position_embedding):
    config = make_config(position_embedding=position_embedding)
    chunk = build_chunks(config, [[0, 1, 2]])[0]
    tokens, positions, labels = make_batch(config)
    logits = chunk(tokens, positions)
    assert logits.shape == (BATCH, SEQ, config.vocab_size)
    losses = chunk(tokens, positions, labels)
    assert losses.shape == (BATCH, SEQ) and losses.dtype == torch.float32
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(BATCH, SEQ)
    torch.testing.assert_close(losses, expected)

    logits_leaf = logits.detach().requires_grad_()
    vocab_parallel_cross_entropy(logits_leaf, labels, TPGroup.single()).sum().backward()
    reference_leaf = logits.detach().requires_grad_()
    F.cross_entropy(reference_leaf.flatten(0, 1), labels.flatten(), reduction="sum").backward()
    torch.testing.assert_close(logits_leaf.grad, reference_leaf.grad)


def test_rope_uses_position_ids():
    config = make_config(position_embedding="rope")
    chunk = build_chunks(config, [[0, 1, 2]])[0]
    tokens, positions, labels = make_batch(config)
    default = chunk(tokens, labels=labels)
    torch.testing.assert_close(default, chunk(tokens, positions, labels))
    stretched = chunk(tokens, positions * 2, labels)
    assert (stretched - default).abs().max() > 1e-5  # small at init: attention is nearly uniform
    # Rotary attention depends on relative positions only: a uniform shift changes nothing.
    torch.testing.assert_close(chunk(tokens, positions + 5, labels), default, rtol=1e-6, atol=1e-6)


def test_rotary_scores_depend_on_relative_position_only():
    head_dim = 8
    query, key = torch.randn(head_dim, dtype=torch.float64), torch.randn(head_dim, dtype=torch.float64)

    def score(query_position, key_position):
        positions = torch.tensor([[query_position, key_position]])
        cos, sin = rotary_cos_sin(positions, head_dim, 10000.0, torch.float64)
        rotated = apply_rotary(torch.stack([query, key]).view(1, 1, 2, head_dim), cos, sin)[0, 0]
        return torch.dot(rotated[0], rotated[1]).item()

    assert score(7, 3) == pytest.approx(score(104, 100), rel=1e-12)
    assert score(7, 3) != pytest.approx(score(7, 4), rel=1e-3)
    assert score(0, 0) == pytest.approx(torch.dot(query, key).item(), rel=1e-12)


def test_bad_config_and_layout_are_refused():
    with pytest.raises(ValueError, match="num_heads"):
        make_config(hidden_size=30)
    with pytest.raises(ValueError, match="position_embedding"):
        make_config(position_embedding="alibi")
    with pytest.raises(ValueError, match="parallel.tp=3"):
        GPTChunk(make_config(), StageLayers.whole(1), RankGroups(tp=TPGroup(None, 3, 0)), seed=SEED)
    with pytest.raises(ValueError, match="layer_ids"):
        GPTChunk(make_config(), StageLayers(0, (0, 3), True, True), seed=SEED)


def test_replicated_parameters():
    assert gpt_rule("layers.7.attn_norm.weight").tp_replicated
    assert gpt_rule("embedding.position.weight").tp_replicated
    assert gpt_rule("layers.0.mlp.fc_out.bias").tp_replicated
    assert not gpt_rule("layers.0.mlp.fc_out.weight").tp_replicated
    assert not gpt_rule("output_layer.weight").tp_replicated
    with pytest.raises(KeyError, match="unknown GPT parameter"):
        gpt_rule("layers.0.attention.dense.weight")


@pytest.mark.parametrize("tie_embeddings", [False, True])
def test_every_parameter_is_used_through_its_own_module(tie_embeddings):
    """The distributed optimizer waits for a parameter's all-gather in a forward pre-hook of the module
    owning it: every parameter-owning module must run as a module before its parameters are used."""
    config = make_config(tie_embeddings=tie_embeddings, position_embedding="learned")
    chunk = GPTChunk(config, StageLayers.whole(config.num_layers), seed=SEED)
    called, owners = [], [module for module in chunk.modules() if list(module.parameters(recurse=False))]
    for module in owners:
        module.register_forward_pre_hook(lambda module, _inputs: called.append(module))
    tokens = torch.randint(0, config.vocab_size, (2, 8))
    chunk(tokens, labels=tokens).sum()
    assert set(map(id, called)) == set(map(id, owners))
