"""The family table: each family's declaration is whole (its weight names cover its layers' parameters, its model
types are its own), and nothing outside the model package's family files names an architecture."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from fusedserve.model.config import EncoderConfig, UnsupportedModel
from fusedserve.model.families import FAMILIES, config_from_hf, family

ROOT = Path(__file__).resolve().parents[2]


_HF = {"vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
       "intermediate_size": 64, "max_position_embeddings": 66, "pad_token_id": 1,
       "dim": 32, "n_layers": 3, "n_heads": 4, "hidden_dim": 64,
       "use_bidirectional_attention": True}  # Gemma3 is served as EmbeddingGemma only (its default is causal)


@pytest.mark.parametrize("fam", FAMILIES, ids=lambda f: f.name)
def test_the_weight_layout_names_every_parameter_of_the_family_encoder(fam):
    config = config_from_hf({**_HF, "model_type": fam.model_types[0]})
    params = set(fam.encoder(config).state_dict())
    mapped, optional = set(fam.weights.embeddings.values()), set()
    for i in range(config.num_layers):
        mapped |= {f"layers.{i}.{ours}" for ours in (*fam.weights.layer.values(), *fam.weights.stacked)}
        optional |= {f"layers.{i}.{ours}" for theirs, ours in fam.weights.layer.items()
                     if theirs in fam.weights.optional}
        if fam.weights.qkv:
            mapped |= {f"layers.{i}.qkv.weight"} | ({f"layers.{i}.qkv.bias"} if config.linear_bias or config.qkv_bias
                                                    else set())
    optional |= {ours for theirs, ours in fam.weights.embeddings.items() if theirs in fam.weights.optional}
    # a family without token types gets one all-zero token type row (model.weights)
    synthesized = ({"embeddings.token_type_embeddings"} if fam.weights.token_types else set()) - mapped
    assert params <= mapped | synthesized
    assert not mapped - params - optional


def test_every_model_type_belongs_to_one_family_and_reads_back_to_it():
    seen: dict[str, str] = {}
    for fam in FAMILIES:
        for model_type in fam.model_types:
            assert model_type not in seen, f"{model_type} claimed by {seen[model_type]} and {fam.name}"
            seen[model_type] = fam.name
    for model_type, name in seen.items():
        config = config_from_hf({**_HF, "model_type": model_type})
        assert family(config).name == name == config.architecture


def test_an_unknown_architecture_is_refused_naming_the_known_ones():
    with pytest.raises(UnsupportedModel, match="architecture 'deberta-v2'; supported: bert, roberta, distilbert, "
                                               "mpnet, gte, nomic_bert, modernbert"):
        family(EncoderConfig(architecture="deberta-v2"))


def _branches_on(tree: ast.AST, names: set[str]) -> list[int]:
    """Lines where a string in `names` is compared with (==, in, a tuple or set compared against), keys a dict or
    indexes a table: a branch on the architecture. A value passed along (a preset's architecture="roberta") is not."""
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    lines = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and node.value in names):
            continue
        parent = parents.get(node)
        if isinstance(parent, (ast.Tuple, ast.List, ast.Set)):
            parent = parents.get(parent)
        if isinstance(parent, (ast.Compare, ast.MatchValue)) or (isinstance(parent, ast.Dict) and node in parent.keys) \
                or (isinstance(parent, ast.Subscript) and parent.slice is node):
            lines.append(node.lineno)
    return lines


def test_nothing_outside_the_family_files_branches_on_the_architecture():
    """The server, the batcher, the routes and the model package's shared code never branch on the architecture:
    that lives in the family files (model/bert.py, ...), declared through model/family.py."""
    names = {f.name for f in FAMILIES} | {t for f in FAMILIES for t in f.model_types}
    family_files = {ROOT / "model" / f"{name}.py" for name in ("bert", "mpnet", "gte", "nomic_bert",
                                                                         "modernbert")}
    found = []
    for folder in ("server", "model", "fusedserve"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path not in family_files:
                found += [f"{path.relative_to(ROOT)}:{line}" for line in _branches_on(ast.parse(path.read_text()), names)]
    assert not found, found


def test_the_branch_finder_sees_a_branch():
    code = 'a = x == "bert"\nb = kind in ("roberta", "y")\nc = {"distilbert": 1}\nd = t["bert"]\ne = f(architecture="bert")'
    assert sorted(_branches_on(ast.parse(code), {"bert", "roberta", "distilbert"})) == [1, 2, 3, 4]
