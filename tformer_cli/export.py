"""`tformer export RUN OUT --to hf`: a Hugging Face ``MarianMTModel`` folder that `transformers` loads
as it stands (``from_pretrained``, ``AutoTokenizer``, ``pipeline("translation")``).

tformer's default architecture is Marian's: post-LN, sinusoidal positions, embeddings scaled by
sqrt(d_model), one vocabulary with tied embeddings. Two details differ and are carried over exactly:

- Marian's position table puts the sine features first and the cosine features after them, where the
  paper (and tformer) interleave them. Every tensor that reads or writes the residual stream is
  permuted accordingly (embedding columns, LayerNorm parameters, the rows or columns of the
  projections into and out of it): the same network in another basis.
- Marian's attention always has biases; tformer's are zero unless ``model.attention_bias``.

The folder holds config.json, generation_config.json, model.safetensors, tokenizer.json (tformer's,
with EOS appended to every text, as tformer encodes sources) and tokenizer_config.json. Writing it
needs no `transformers`; loading it does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor

from tformer_cli.config import Config, ModelConfig
from tformer_cli.errors import UsageError, first_line
from tformer_cli.files import replacing
from tformer_cli.tokenizer import BOS, BOS_ID, EOS, EOS_ID, PAD, PAD_ID, UNK, Vocabulary


def check_marian(config: Config, vocab: Vocabulary) -> None:
    """One line naming the first setting Marian cannot express."""
    m = config.model
    refused = [
        (m.norm != "post", f"model.norm {m.norm}: Marian is post-LN"),
        (m.positional != "sinusoidal", f"model.positional {m.positional}: Marian has sinusoidal positions only"),
        (m.share_embeddings != "all", f"model.share_embeddings {m.share_embeddings}: the export needs one "
                                      "embedding matrix for source, target and output (all)"),
        (not vocab.joint, "separate source and target vocabularies: the export needs one joint vocabulary"),
        (m.layer_norm_eps != 1e-5, f"model.layer_norm_eps {m.layer_norm_eps}: Marian's LayerNorms use 1e-5"),
        (m.num_encoder_layers == 0 or m.num_decoder_layers == 0, "an empty encoder or decoder stack"),
    ]
    for bad, why in refused:
        if bad:
            raise UsageError(f"--to hf: {why}; a run with this setting cannot be exported to Marian")


def marian_config(config: Config, vocab_size: int) -> dict:
    m = config.model
    return {
        "architectures": ["MarianMTModel"], "model_type": "marian", "is_encoder_decoder": True,
        "vocab_size": vocab_size, "decoder_vocab_size": vocab_size, "d_model": m.d_model,
        "encoder_layers": m.num_encoder_layers, "decoder_layers": m.num_decoder_layers,
        "encoder_attention_heads": m.num_heads, "decoder_attention_heads": m.num_heads,
        "encoder_ffn_dim": m.d_ff, "decoder_ffn_dim": m.d_ff, "activation_function": m.activation,
        "max_position_embeddings": m.max_len, "scale_embedding": True, "share_encoder_decoder_embeddings": True,
        "tie_word_embeddings": True, "dropout": m.dropout, "attention_dropout": m.attention_dropout,
        "activation_dropout": 0.0, "init_std": 0.02, "encoder_layerdrop": 0.0, "decoder_layerdrop": 0.0,
        "pad_token_id": PAD_ID, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "decoder_start_token_id": BOS_ID,
        "use_cache": True,
    }


def generation_config(config: Config) -> dict:
    """tformer's decoding defaults for `generate` and pipelines (the length limit is the model's)."""
    return {"decoder_start_token_id": BOS_ID, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
            "pad_token_id": PAD_ID, "bad_words_ids": [[PAD_ID], [BOS_ID]], "num_beams": config.decode.beam_size,
            "max_length": config.model.max_len}


@torch.no_grad()
def marian_state_dict(model: torch.nn.Module, d_model: int) -> dict[str, Tensor]:
    """tformer's weights under Marian's names, in Marian's basis of the residual stream."""
    basis = torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])  # sines first, then cosines

    def reads(w: Tensor) -> Tensor:  # a matrix whose columns are the residual stream
        return w[:, basis].contiguous()

    def writes(w: Tensor) -> Tensor:  # rows (or a vector) in the residual stream
        return w[basis].contiguous()

    def bias_of(layer: torch.nn.Linear) -> Tensor:
        return layer.bias if layer.bias is not None else torch.zeros(layer.weight.shape[0])

    def reading(name: str, weight: Tensor, bias: Tensor) -> dict[str, Tensor]:  # residual stream -> elsewhere
        return {f"{name}.weight": reads(weight), f"{name}.bias": bias}

    def writing(name: str, weight: Tensor, bias: Tensor) -> dict[str, Tensor]:  # elsewhere -> residual stream
        return {f"{name}.weight": writes(weight), f"{name}.bias": writes(bias)}

    def norm(name: str, layer: torch.nn.LayerNorm) -> dict[str, Tensor]:
        return {f"{name}.weight": writes(layer.weight), f"{name}.bias": writes(layer.bias)}

    def ffn(prefix: str, layer: torch.nn.Module) -> dict[str, Tensor]:
        return (reading(f"{prefix}.fc1", layer.linear1.weight, bias_of(layer.linear1))
                | writing(f"{prefix}.fc2", layer.linear2.weight, bias_of(layer.linear2)))

    def attention(name: str, attn: torch.nn.Module) -> dict[str, Tensor]:
        if attn.cross:
            weights = [attn.q_proj.weight, *attn.kv_proj.weight.chunk(2)]
            biases = [bias_of(attn.q_proj), *bias_of(attn.kv_proj).chunk(2)]
        else:
            weights, biases = attn.qkv_proj.weight.chunk(3), bias_of(attn.qkv_proj).chunk(3)
        out = {}
        for part, weight, bias in zip("qkv", weights, biases):
            out |= reading(f"{name}.{part}_proj", weight, bias)
        return out | writing(f"{name}.out_proj", attn.out_proj.weight, bias_of(attn.out_proj))

    embedding = reads(model.encoder.embed.embedding.weight)
    state = {"model.shared.weight": embedding, "model.encoder.embed_tokens.weight": embedding.clone(),
             "model.decoder.embed_tokens.weight": embedding.clone(), "lm_head.weight": embedding.clone(),
             "final_logits_bias": torch.zeros(1, embedding.shape[0])}
    for i, layer in enumerate(model.encoder.layers):
        prefix = f"model.encoder.layers.{i}"
        state |= attention(f"{prefix}.self_attn", layer.self_attn) | norm(f"{prefix}.self_attn_layer_norm", layer.norm1)
        state |= ffn(prefix, layer.ffn) | norm(f"{prefix}.final_layer_norm", layer.norm2)
    for i, layer in enumerate(model.decoder.layers):
        prefix = f"model.decoder.layers.{i}"
        state |= attention(f"{prefix}.self_attn", layer.self_attn) | norm(f"{prefix}.self_attn_layer_norm", layer.norm1)
        state |= attention(f"{prefix}.encoder_attn", layer.cross_attn)
        state |= norm(f"{prefix}.encoder_attn_layer_norm", layer.norm2)
        state |= ffn(prefix, layer.ffn) | norm(f"{prefix}.final_layer_norm", layer.norm3)
    return {name: tensor.float().contiguous() for name, tensor in state.items()}


def export_hf(model: torch.nn.Module, config: Config, vocab: Vocabulary, out: Path) -> Path:
    """Write the Marian folder ``out`` (created; refused if it holds anything)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, processors

    check_marian(config, vocab)
    with _new_folder(out) as tmp:
        weights = marian_state_dict(model, config.model.d_model)
        save_file(weights, str(tmp / "model.safetensors"), {"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(marian_config(config, vocab.src_size), indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(generation_config(config), indent=2) + "\n")
        tokenizer = Tokenizer.from_str(vocab.source.to_str())  # a copy, given the post-processor below
        tokenizer.post_processor = processors.TemplateProcessing(single=f"$A {EOS}", pair=f"$A {EOS} $B {EOS}",
                                                                 special_tokens=[(EOS, EOS_ID)])
        tokenizer.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "pad_token": PAD, "bos_token": BOS, "eos_token": EOS,
            "unk_token": UNK, "model_max_length": config.model.max_len}, indent=2) + "\n")
    return Path(out)


QUANTIZATIONS = ("int8", "int8_float16", "int8_float32", "int8_bfloat16", "float16", "bfloat16")


def export_ctranslate2(model: torch.nn.Module, config: Config, vocab: Vocabulary, out: Path,
                       quantization: str | None = None) -> Path:
    """Write a CTranslate2 model folder ``out`` through CTranslate2's spec API (its Marian converter
    would start the decoder from a zero embedding; tformer's decoder starts from BOS). The spec is
    OpenNMT's Transformer, whose layout tformer shares: fused Q/K/V, interleaved position tables,
    post- or pre-LN. Sources get EOS appended by CTranslate2 itself (``add_source_eos``), so callers
    pass the tokenizer's tokens as they are; tokenizer.json is copied beside the model for them."""
    import importlib.util

    if importlib.util.find_spec("ctranslate2") is None:
        raise UsageError("--to ctranslate2: the ctranslate2 package is not installed; pip install "
                         "'tformer[ctranslate2]'")
    m = config.model
    if m.positional not in ("sinusoidal", "learned"):
        raise UsageError(f"--to ctranslate2: model.positional {m.positional}: CTranslate2's encoder-decoder "
                         "Transformer takes position tables only (sinusoidal or learned)")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise UsageError(f"--quantization {quantization}: expected one of {', '.join(QUANTIZATIONS)}")
    with _new_folder(out) as tmp:
        spec = ctranslate2_spec(model, m, vocab.source_tokens(list(range(vocab.src_size))),
                                vocab.target_tokens(list(range(vocab.tgt_size))))
        spec.validate()
        spec.optimize(quantization=quantization)
        spec.save(str(tmp))
        vocab.save(tmp)  # the tokenizer(s), for callers to turn text into tokens and back
    return Path(out)


def push(folder: Path, repo: str) -> None:
    """Upload an exported folder to a Hub model repository (created if missing)."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        api.create_repo(repo, exist_ok=True)
        api.upload_folder(repo_id=repo, folder_path=str(folder))
    except Exception as exc:  # offline, not logged in, no rights: the hub client's own errors
        raise UsageError(f"--push-to-hub {repo}: {first_line(exc)}; the export is in {folder}") from None


def ctranslate2_spec(model: torch.nn.Module, m: ModelConfig, source_tokens: list[str], target_tokens: list[str]):
    """The ``ctranslate2.specs.TransformerSpec`` of a tformer model, its vocabularies registered."""
    from ctranslate2.specs import common_spec, transformer_spec

    activation = {"relu": common_spec.Activation.RELU, "gelu": common_spec.Activation.GELU}[m.activation]
    spec = transformer_spec.TransformerSpec.from_config((m.num_encoder_layers, m.num_decoder_layers), m.num_heads,
                                                        pre_norm=m.norm == "pre", activation=activation)

    def tensor(t: Tensor) -> Tensor:
        return t.detach().float().contiguous()

    def linear(target, layer: torch.nn.Linear) -> None:
        target.weight = tensor(layer.weight)
        if layer.bias is not None:
            target.bias = tensor(layer.bias)

    def layer_norm(target, norm: torch.nn.LayerNorm) -> None:
        target.gamma, target.beta = tensor(norm.weight), tensor(norm.bias)

    def inputs(target, stack: torch.nn.Module) -> None:
        embed = stack.embed
        table = embed.table if embed.table is not None else embed.learned.weight
        target.position_encodings.encodings = tensor(table)
        target.scale_embeddings = True
        embeddings = target.embeddings[0] if isinstance(target.embeddings, list) else target.embeddings
        embeddings.weight = tensor(embed.embedding.weight)
        if m.norm == "pre":
            layer_norm(target.layer_norm, stack.final_norm)

    def ffn(target, layer: torch.nn.Module, norm: torch.nn.LayerNorm) -> None:
        linear(target.linear_0, layer.linear1)
        linear(target.linear_1, layer.linear2)
        layer_norm(target.layer_norm, norm)

    inputs(spec.encoder, model.encoder)
    for target, layer in zip(spec.encoder.layer, model.encoder.layers):
        linear(target.self_attention.linear[0], layer.self_attn.qkv_proj)
        linear(target.self_attention.linear[1], layer.self_attn.out_proj)
        layer_norm(target.self_attention.layer_norm, layer.norm1)
        ffn(target.ffn, layer.ffn, layer.norm2)
    inputs(spec.decoder, model.decoder)
    for target, layer in zip(spec.decoder.layer, model.decoder.layers):
        linear(target.self_attention.linear[0], layer.self_attn.qkv_proj)
        linear(target.self_attention.linear[1], layer.self_attn.out_proj)
        layer_norm(target.self_attention.layer_norm, layer.norm1)
        linear(target.attention.linear[0], layer.cross_attn.q_proj)
        linear(target.attention.linear[1], layer.cross_attn.kv_proj)
        linear(target.attention.linear[2], layer.cross_attn.out_proj)
        layer_norm(target.attention.layer_norm, layer.norm2)
        ffn(target.ffn, layer.ffn, layer.norm3)
    spec.decoder.projection.weight = tensor(model.output_proj.weight)
    spec.config.layer_norm_epsilon = m.layer_norm_eps
    spec.config.add_source_eos = True
    spec.config.decoder_start_token = BOS
    spec.register_source_vocabulary(source_tokens)
    spec.register_target_vocabulary(target_tokens)
    return spec


@contextmanager
def _new_folder(out: Path) -> Iterator[Path]:
    """A temporary folder to write the export into, renamed to ``out`` (new or empty) once complete:
    an export cut short leaves nothing behind."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out}: exists and is not an empty folder; name a new folder for the export")
    out.parent.mkdir(parents=True, exist_ok=True)
    with replacing(out) as tmp:
        tmp.mkdir()
        yield tmp
