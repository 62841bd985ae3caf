"""Keep the body, swap the head: embeddings, a reranker and a trained classification head on one loaded model.

    .venv/bin/python examples/swap_the_head.py [--model gemma-3-270m]

1. embeddings of a few sentences (the final hidden state, mean-pooled) and their cosine similarities;
2. a query's documents reranked by two rows of the LM head ("yes" against "no" at the last position) — the
   rule of a model trained for it (Qwen3-Reranker: a `qwen3` GGUF file, `--model path/to/it.gguf`); a small chat
   model's scores say little;
3. a 4-class head trained on lmhead's shipped topic set (lmhead.data), its held-out accuracy beside the zero-shot
   verbaliser's and scikit-learn's logistic regression (where installed) on the same features;
4. one hidden state through the LM head and through that head (explain_swap).
"""

from __future__ import annotations

import argparse

import lmhead
from lmhead.data import topics
from lmhead.explain_swap import render_swap, swap
from lmhead.heads.train import baselines, cached_features


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma-3-270m")
    args = ap.parse_args()
    model = lmhead.load_model(args.model, progress=False)

    sentences = ["The striker scored twice.", "The team won the cup final.", "Whisk the eggs with sugar."]
    emb = model.embed(sentences, pooling="mean")                      # [3, D], unit rows
    print("cosine similarities (mean pooling):")
    for i, s in enumerate(sentences):
        print(f"  {s:32} " + "  ".join(f"{float(emb[i] @ emb[j]):.3f}" for j in range(len(sentences))))

    print("\nreranked by the LM head's 'yes' against 'no':")
    for r in model.rerank("Who won the match?", ["Stir the onions slowly.", "The home side won 2-1.",
                                                  "Shares fell on Monday."]):
        print(f"  {r['relevance_score']:.3f}  {r['document']}")

    texts, labels = topics()
    x = cached_features(model, texts, "last", "Text: {text}\nTopic:")   # the body once; cached on disk
    head = lmhead.train_head(model, texts, labels, x=x)
    acc = baselines(model, head, x, labels)
    lr = acc["logistic_regression"]
    print(f"\ntopic head {len(head.labels)} × {head.width} on {head.report.train_size} sentences, held out "
          f"{head.report.val_size}: accuracy {acc['head']:.3f}, zero-shot {acc['zero_shot']:.3f}, logistic "
          f"regression {'-' if lr is None else f'{lr:.3f}'}\n")
    print(render_swap(swap(model, "The central bank raised interest rates again.", head, top=5)))


if __name__ == "__main__":
    main()
