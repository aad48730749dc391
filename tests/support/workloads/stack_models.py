"""Real models for the real-stack cold-start tests and bench, built from configs with random
weights and saved locally (nothing is downloaded): ``python stack_models.py DIR [tiny|medium]``.

DIR/bert   BertForSequenceClassification + a WordPiece tokenizer (save_pretrained, safetensors)
DIR/gpt2   GPT2LMHeadModel + a BPE tokenizer
DIR/bert_state.pt        the BERT state dict for torch.load (zip format, mmap-able)
DIR/bert.safetensors     the same for safetensors.torch.load_file
DIR/scripted.pt          a traced TorchScript BERT encoder, DIR/tokenizer.json beside it
"""

from __future__ import annotations

import os
import sys

WORDS = ("the quick brown fox jumps over the lazy dog while a cold start warms up slowly "  # noqa: SIM905
         "models load weights tokenizers split words into pieces and servers answer requests").split()


def _train_tokenizer(kind: str):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    corpus = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))]
    if kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        trainer = trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]",
                                                                             "[MASK]"])
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<|endoftext|>"])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(corpus, trainer)
    return tok


SIZES = {  # hidden, layers, intermediate, vocabulary (of the model, not of the tokenizer)
    "tiny": (64, 2, 128, 200),
    "medium": (512, 8, 2048, 30522),  # about 41M parameters, like the stacks in issue 11
}


def build(out: str, size: str = "tiny") -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        GPT2Config,
        GPT2LMHeadModel,
        PreTrainedTokenizerFast,
    )

    torch.manual_seed(0)
    os.makedirs(out, exist_ok=True)
    wp = _train_tokenizer("wordpiece")
    bert_dir = os.path.join(out, "bert")
    hidden, layers, inter, vocab = SIZES[size]
    cfg = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
                     intermediate_size=inter, max_position_embeddings=64, num_labels=2)
    bert = BertForSequenceClassification(cfg).eval()
    bert.save_pretrained(bert_dir, safe_serialization=True)
    PreTrainedTokenizerFast(tokenizer_object=wp, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                            sep_token="[SEP]", mask_token="[MASK]").save_pretrained(bert_dir)
    wp.save(os.path.join(out, "tokenizer.json"))

    bpe = _train_tokenizer("bpe")
    gpt_dir = os.path.join(out, "gpt2")
    gcfg = GPT2Config(vocab_size=vocab, n_positions=64, n_embd=hidden, n_layer=layers, n_head=2,
                      bos_token_id=1, eos_token_id=1, pad_token_id=1)
    GPT2LMHeadModel(gcfg).eval().save_pretrained(gpt_dir, safe_serialization=True)
    PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", eos_token="<|endoftext|>",
                            bos_token="<|endoftext|>", pad_token="<|endoftext|>").save_pretrained(gpt_dir)

    sd = {k: v.contiguous() for k, v in bert.state_dict().items()}
    torch.save(sd, os.path.join(out, "bert_state.pt"))
    save_file(sd, os.path.join(out, "bert.safetensors"))
    ids = torch.zeros(1, 8, dtype=torch.long)
    traced = torch.jit.trace(bert.bert, (ids,), strict=False)
    torch.jit.save(traced, os.path.join(out, "scripted.pt"))


if __name__ == "__main__":
    build(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "tiny")
