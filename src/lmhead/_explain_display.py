"""Terminal display (rich) of explain.py's results: `lmhead predict` and `lmhead eval`. Printing only."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from lmhead.explain import Evaluation, Prediction

# GLTR's colours: the actual token was the model's top-1 / in its top 10 / top 100 / beyond.
RANK_BUCKETS = [(1, "top-1", "black on green3"), (10, "top-10", "black on yellow3"),
                (100, "top-100", "black on red3"), (None, "beyond", "white on purple4")]

_CUT_NAMES = {"constraint": "constraint", "bias": "banned", "greedy": "greedy", "top_k": "top-k", "top_p": "top-p",
              "min_p": "min-p"}


def _pct(p: float) -> str:
    if p == 0:
        return "0"
    if p < 0.0001:
        return f"{p * 100:.1e}%"
    return f"{p * 100:.2f}%"


def _short_pct(p: float) -> str:
    return "<1%" if p < 0.01 else f"{p * 100:.0f}%"


def _num(x: float | None, fmt: str = "{:.3f}") -> str:
    return "-inf" if x is None or x == float("-inf") else fmt.format(x)


def _config_line(config: dict) -> str:
    defaults = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
                "presence_penalty": 0.0, "frequency_penalty": 0.0}
    parts = [f"{k.replace('_', '-')} {config[k]:g}" for k, v in defaults.items()
             if k in config and config[k] is not None and config[k] != v]
    if config.get("temperature", 1.0) < 1e-5:
        parts = ["temperature 0 (greedy: logit/T shows the logit)"] + [
            p for p in parts if not p.startswith(("temperature", "top-", "min-"))]
    return ", ".join(parts) or "defaults (temperature 1, no cuts)"


def prompt_tokens_text(tokens) -> Text:
    """The prompt's tokens side by side, each followed by its id (dim), separated by "│"."""
    text = Text()
    for i, tok in enumerate(tokens):
        if i:
            text.append(" │ ", style="dim")
        text.append(tok.text, style="bold")
        text.append(f" {tok.token_id}", style="dim")
    return text


def print_prediction(pred: Prediction, console: Console | None = None) -> None:
    console = console or Console()
    console.print(Text(f"model {pred.model} · {len(pred.prompt_tokens)} prompt tokens · vocabulary "
                       f"{pred.vocab_size:,} · {_config_line(pred.config)}", style="bold"))
    console.print(prompt_tokens_text(pred.prompt_tokens))
    if pred.constraint is not None:
        console.print(Text(f"constraint (applied first): {pred.constraint}", style="bold"))
    table = Table(title="next token", title_justify="left", show_edge=False, pad_edge=False)
    for name, justify in [("#", "right"), ("token", "left"), ("id", "right"), ("logit", "right"),
                          ("logit/T", "right"), ("raw", "right"),
                          ("processed", "right"), ("cumulative", "right"), ("kept", "left")]:
        table.add_column(name, justify=justify)
    for c in pred.candidates:
        style = None if c.kept else "dim strike"
        kept = Text("✓", style="green") if c.kept else Text(f"✗ {_CUT_NAMES.get(c.cut_by, c.cut_by)}", style="red")
        table.add_row(str(c.rank), Text(c.text, style=style), str(c.token_id), _num(c.logit),
                      _num(c.scaled_logit), _pct(c.raw_probability), _pct(c.probability),
                      _pct(c.cumulative), kept)
    console.print(table)
    e = pred.entropy
    console.print(f"entropy: raw {max(0.0, e['raw']):.3f} nats · after temperature {max(0.0, e['scaled']):.3f} · "
                  f"processed {max(0.0, e['processed']):.3f}", highlight=False)
    console.print(f"kept: {pred.kept_count:,} of {pred.vocab_size:,} tokens", highlight=False)
    if pred.head == "fp32":
        console.print("logits: the model's full-precision head (exact)", style="dim", highlight=False)
    else:
        console.print(f"logits: the {pred.head} head (compressed: the candidates shown are re-scored exactly, "
                      "the rest of the vocabulary is approximate; fp32 shows the model's own numbers)",
                      style="yellow", highlight=False)
    if pred.layers:
        print_lens(pred, console)


def print_lens(pred: Prediction, console: Console) -> None:
    last = pred.layers[-1]
    final = last.candidates[0]
    table = Table(title="logit lens: final norm + head after each layer",
                  caption=f"p(final), rank: the final layer's top-1 {final.text!r} at each layer",
                  title_justify="left", caption_justify="left", show_edge=False, pad_edge=False)
    shown = max(1, min(len(last.candidates), (console.width - 36) // 12))  # what fits the terminal
    table.add_column("layer", justify="right", no_wrap=True, min_width=5)
    for i in range(shown):
        table.add_column(f"top-{i + 1}", no_wrap=True, overflow="ellipsis")
    table.add_column("entropy", justify="right", no_wrap=True, min_width=7)
    table.add_column("p(final)", justify="right", no_wrap=True, min_width=8)
    table.add_column("rank", justify="right", no_wrap=True, min_width=4)
    for layer in pred.layers:
        name = "embed" if layer.layer == 0 else str(layer.layer)
        cells = [Text(c.text, style="bold" if c.token_id == final.token_id else None)
                 + Text(f" {_short_pct(c.probability)}", style="dim") for c in layer.candidates[:shown]]
        table.add_row(name, *cells, f"{max(0.0, layer.entropy):.2f}", _pct(layer.final_token_probability),
                      str(layer.final_token_rank))
    console.print(table)


def _bucket(rank: int) -> tuple[str, str]:
    for limit, name, style in RANK_BUCKETS:
        if limit is None or rank <= limit:
            return name, style
    raise AssertionError("unreachable")


def print_evaluation(ev: Evaluation, console: Console | None = None) -> None:
    console = console or Console()
    if ev.tokens:
        text = Text()
        counts = {name: 0 for _, name, _ in RANK_BUCKETS}
        for tok in ev.tokens:
            if tok.rank is None:  # the first token: nothing predicts it
                text.append(tok.segment, style="dim")
                continue
            name, style = _bucket(tok.rank)
            counts[name] += 1
            text.append(tok.segment, style=style)
        console.print(text)
        legend = Text("legend: ")
        for _, name, style in RANK_BUCKETS:
            legend.append(f" {name} ", style=style)
            legend.append(f" {counts[name]}  ")
        console.print(legend)
    console.print(f"perplexity [bold]{ev.perplexity:.4f}[/bold] · loss {ev.loss:.4f} nats/token · "
                  f"{ev.scored_count:,} tokens scored of {ev.token_count:,} · model {ev.model} · "
                  f"window {ev.window}, stride {ev.stride}, {ev.windows} window{'s' if ev.windows != 1 else ''}",
                  highlight=False)
