"""Real serving stacks for the cold-start tests and bench, with no infersight call in them.

    python stacks.py STACK MODELS_DIR [PORT]

MODELS_DIR comes from ``stack_models.py``. Each stack loads a model the way its users do,
answers one inference, and exits; the ``fastapi`` stack serves until its first request
(send one GET to http://127.0.0.1:PORT/, e.g. with ``launch --probe``).
"""

from __future__ import annotations

import os
import sys

TEXT = "the quick brown fox jumps over the lazy dog"


def pipeline_stack(models: str) -> None:
    from transformers import pipeline

    clf = pipeline("text-classification", model=os.path.join(models, "bert"), device="cpu")
    print(clf(TEXT))


def causal_lm(models: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = os.path.join(models, "gpt2")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    ids = tok(TEXT, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=5, do_sample=False)
    print(out.shape)


def meta_load_file(models: str) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForSequenceClassification

    cfg = AutoConfig.from_pretrained(os.path.join(models, "bert"))
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(cfg)
    model.load_state_dict(load_file(os.path.join(models, "bert.safetensors")), assign=True, strict=False)
    model.eval()
    with torch.no_grad():
        print(model(torch.zeros(1, 8, dtype=torch.long)).logits.shape)


def torch_load_mmap(models: str) -> None:
    import torch
    from transformers import AutoConfig, BertForSequenceClassification

    model = BertForSequenceClassification(AutoConfig.from_pretrained(os.path.join(models, "bert")))
    state = torch.load(os.path.join(models, "bert_state.pt"), mmap=True, weights_only=True)
    model.load_state_dict(state, strict=False)
    model.eval()
    with torch.no_grad():
        print(model(torch.zeros(1, 8, dtype=torch.long)).logits.shape)


def compiled(models: str) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(os.path.join(models, "bert")).eval()
    fast = torch.compile(model, backend="inductor")
    with torch.no_grad():
        print(fast(torch.zeros(1, 8, dtype=torch.long)).logits.shape)


def torchscript(models: str) -> None:
    import torch
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(models, "tokenizer.json"))
    model = torch.jit.load(os.path.join(models, "scripted.pt"))
    try:  # "is there a GPU?" the way servers ask it; on a CPU build this raises
        device = "cuda:%d" % torch.cuda.current_device()
    except (AssertionError, RuntimeError):
        device = "cpu"
    model.to(device)
    ids = torch.tensor([tok.encode(TEXT).ids[:8]])
    with torch.no_grad():
        out = model(ids)
    print(type(out).__name__)


def fastapi_stack(models: str, port: str) -> None:
    import uvicorn

    os.environ["STACK_MODELS"] = models
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import stack_app

    config = uvicorn.Config(stack_app.app, host="127.0.0.1", port=int(port), log_level="warning")
    server = uvicorn.Server(config)
    stack_app.on_first_request = lambda: setattr(server, "should_exit", True)
    server.run()


STACKS = {
    "pipeline": pipeline_stack,
    "causal_lm": causal_lm,
    "meta_load_file": meta_load_file,
    "torch_load_mmap": torch_load_mmap,
    "compile": compiled,
    "torchscript": torchscript,
}

if __name__ == "__main__":
    name, models = sys.argv[1], sys.argv[2]
    if name == "fastapi":
        fastapi_stack(models, sys.argv[3])
    else:
        STACKS[name](models)
