"""`lmhead embed`, `rerank`, `classify` and `train-head`: the body alone and the heads on it."""

from __future__ import annotations

import argparse
import json
import sys

from lmhead.cli.args import add_model_arg, load_model_of, print_json, read_text

# --- the body alone and the heads on it: embed, rerank, classify, train-head ---------------------------------


def _texts_of(args: argparse.Namespace, what: str = "TEXT") -> list[str]:
    """The texts of the positional arguments, or of --input FILE ('-': stdin): a .jsonl file's "text" fields,
    else one text a line (blank lines skipped); a line that is not what it should be names the file and line."""
    if args.input is None:
        if not args.texts:
            raise ValueError(f"give {what} arguments or --input FILE")
        return list(args.texts)
    if args.texts:
        raise ValueError(f"give {what} arguments or --input FILE, not both")
    texts = []
    for n, line in enumerate(read_text(args.input).splitlines(), 1):
        if not line.strip():
            continue
        if args.input.endswith(".jsonl"):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{args.input} line {n}: not JSON ({exc.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("text"), str) or not row["text"]:
                raise ValueError(f"{args.input} line {n}: \"text\" is missing or not a non-empty string")
            line = row["text"]
        texts.append(line)
    if not texts:
        raise ValueError(f"{args.input} holds no text")
    return texts


def add_texts_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("texts", nargs="*", metavar="TEXT", help="the texts (or --input)")
    p.add_argument("--input", "-i", default=None, metavar="FILE",
                   help="read the texts from FILE ('-': stdin): one a line, or a .jsonl file's \"text\" fields")
    p.add_argument("--truncate", type=int, default=None, metavar="N",
                   help="keep each input's last N tokens (default: an input past the context is an error)")


def add_embed(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("embed", help="embeddings: the body alone, its final hidden state pooled",
                       description="Embed texts with the model's body alone: the final hidden state (after the "
                                   "final norm), pooled and L2-normalised. Writes JSON lines {index, embedding} "
                                   "to stdout, or --out FILE (.npy: one [N, D] float32 array; .jsonl).")
    add_model_arg(p)
    add_texts_args(p)
    p.add_argument("--pooling", default=None, choices=["last", "mean", "cls"],
                   help="default: the file's pooling_type, else last (a decoder's last token sees the whole text)")
    p.add_argument("--no-normalize", action="store_true", help="leave the vectors as they are (no L2 norm)")
    p.add_argument("--out", "-o", default=None, metavar="FILE", help="write to FILE (.npy or .jsonl)")
    p.set_defaults(run=_run_embed)


def _run_embed(args: argparse.Namespace) -> None:
    if args.out is not None and not args.out.endswith((".npy", ".jsonl")):
        raise ValueError(f"--out {args.out}: the name must end in .npy or .jsonl")
    texts = _texts_of(args)
    from lmhead.heads.pooling import embed

    model = load_model_of(args)
    vectors = embed(model, texts, pooling=args.pooling, normalize=not args.no_normalize,
                    truncate_prompt_tokens=args.truncate)
    if args.out is not None and args.out.endswith(".npy"):
        import numpy as np

        np.save(args.out, vectors.numpy().astype(np.float32))
    else:
        lines = [json.dumps({"index": i, "embedding": v.tolist()}) for i, v in enumerate(vectors)]
        if args.out is None:
            sys.stdout.write("".join(x + "\n" for x in lines))
            return
        with open(args.out, "w", encoding="utf-8") as f:
            f.write("".join(x + "\n" for x in lines))
    print(f"lmhead: {len(texts)} embeddings of {vectors.shape[1]} values written to {args.out}", file=sys.stderr)


def add_rerank(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rerank", help="rank documents by relevance to a query",
                       description="Score each document against QUERY at the last position of a reranker "
                                   "prompt: the LM head's logit of 'yes' against 'no' (Qwen3-Reranker's rule), or "
                                   "the file's classification head (pooling rank). Prints JSON lines {index, "
                                   "relevance_score, document}, best first.")
    add_model_arg(p)
    p.add_argument("query", metavar="QUERY")
    add_texts_args(p)
    p.add_argument("--top-n", type=int, default=None, metavar="N", help="print the best N only")
    p.set_defaults(run=_run_rerank)


def _run_rerank(args: argparse.Namespace) -> None:
    docs = _texts_of(args, "DOCUMENT")
    from lmhead.heads.reranker import rerank

    model = load_model_of(args)
    for r in rerank(model, args.query, docs, top_n=args.top_n, truncate_prompt_tokens=args.truncate):
        print_json(r)


def add_classify(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("classify", help="classify texts with a classification head on the body",
                       description="Classify texts with a head saved by `lmhead train-head` (--head FILE), or "
                                   "the model file's own classification head. Prints JSON lines {index, label, "
                                   "probs}.")
    add_model_arg(p)
    add_texts_args(p)
    p.add_argument("--classifier", default=None, metavar="FILE",
                   help="the head (.safetensors from train-head); default: the model file's cls.output head")
    p.add_argument("--explain", action="store_true",
                   help="show the swap instead: each text's final hidden state through the LM head (its top "
                        "tokens of the whole vocabulary) and through the classification head, with each head's "
                        "size and share of the model")
    p.set_defaults(run=_run_classify)


def classifier_head(path: str | None, model):
    from lmhead.heads.classifier import ClassificationHead, from_file

    if path is not None:
        try:
            head = ClassificationHead.load(path)
        except FileNotFoundError:
            raise ValueError(f"--classifier {path}: no such file") from None
        head.check_model(model)
        return head
    head = from_file(model)
    if head is None:
        raise ValueError("--classifier: the model's file holds no classification head; train one with "
                         "`lmhead train-head` and give its file")
    return head


def _run_classify(args: argparse.Namespace) -> None:
    texts = _texts_of(args)
    model = load_model_of(args)
    from lmhead.heads.classifier import classify

    head = classifier_head(args.classifier, model)
    if args.explain:
        from lmhead.explain_swap import render_swap, swap

        print("\n\n".join(render_swap(swap(model, t, head)) for t in texts))
        return
    for i, p in enumerate(classify(model, texts, head)):
        print_json({"index": i, "label": head.labels[int(p.argmax())],
                     "probs": dict(zip(head.labels, [round(v, 6) for v in p.tolist()], strict=True))})


def add_train_head(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-head", help="fit a classification head on the frozen body (seconds on a CPU)",
                       description="Fit a [K, D] classification head on the frozen body's pooled features of a "
                                   "JSONL file of {\"text\", \"label\"} lines, with lmhead's fused linear "
                                   "cross-entropy; save it with its label names. Reports held-out accuracy "
                                   "against the zero-shot verbaliser (the LM head's rows of the label words) and "
                                   "scikit-learn's LogisticRegression on the same features.")
    add_model_arg(p)
    p.add_argument("data", metavar="DATA.jsonl", help="one {\"text\": ..., \"label\": ...} a line")
    p.add_argument("--out", "-o", required=True, metavar="FILE", help="where to save the head (.safetensors)")
    p.add_argument("--start", default="verbaliser", choices=["verbaliser", "random"],
                   help="the head's start: the LM head's rows of the label words (default), or random")
    p.add_argument("--template", default=None, metavar="TEXT",
                   help="the prompt around each text, with {text} (default: 'Text: {text}\\nTopic:')")
    p.add_argument("--pooling", default="last", choices=["last", "mean", "cls"], help="default: last")
    p.add_argument("--label-smoothing", type=float, default=0.0, metavar="E", help="in [0, 1) (default 0)")
    p.add_argument("--class-weights", default=None, choices=["balanced"], help="weigh rare classes up")
    p.add_argument("--max-steps", type=int, default=500, metavar="N", help="full-batch steps at most (500)")
    p.add_argument("--patience", type=int, default=50, metavar="N",
                   help="stop after N steps without a better held-out loss (50)")
    p.add_argument("--val-fraction", type=float, default=0.2, metavar="F", help="held out (default 0.2)")
    p.add_argument("--lr", type=float, default=1e-3, metavar="R", help="Adam's rate (default 0.001)")
    p.add_argument("--seed", type=int, default=0, help="the split's and the random start's seed (0)")
    p.set_defaults(run=_run_train_head)


def _run_train_head(args: argparse.Namespace) -> None:
    from lmhead.heads.classifier import DEFAULT_TEMPLATE
    from lmhead.heads.train import baselines, cached_features, read_labelled, train_head

    if not args.out.endswith(".safetensors"):
        raise ValueError(f"--out {args.out}: the name must end in .safetensors")
    try:
        texts, labels = read_labelled(args.data)
    except FileNotFoundError:
        raise ValueError(f"{args.data}: no such file") from None
    template = args.template or DEFAULT_TEMPLATE
    if "{text}" not in template:
        raise ValueError(f"--template must contain {{text}}; got {template!r}")
    model = load_model_of(args)
    x = cached_features(model, texts, args.pooling, template)
    head = train_head(model, texts, labels, start=args.start, template=template, pooling=args.pooling,
                      label_smoothing=args.label_smoothing, class_weights=args.class_weights, lr=args.lr,
                      max_steps=args.max_steps, patience=args.patience, val_fraction=args.val_fraction,
                      seed=args.seed, x=x, progress=sys.stderr.isatty())
    head.save(args.out)
    acc = baselines(model, head, x, labels, args.val_fraction, args.seed)
    r = head.report
    lr = acc["logistic_regression"]
    print_json({"out": args.out, "classes": head.labels, "train": r.train_size, "held_out": r.val_size,
                 "steps": r.steps, "best_step": r.best_step, "accuracy": round(acc["head"], 4),
                 "zero_shot_accuracy": round(acc["zero_shot"], 4),
                 "logistic_regression_accuracy": None if lr is None else round(lr, 4),
                 "parameters": head.num_parameters})


# --- commands added by later issues register here ----------------------------------------------------------
