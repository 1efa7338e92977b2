"""docs/tour.py: writes docs/tour.md, one step of grpo_minimal.py on the bundled tiny model with its real tensors,
the line of code that made each one, and a paragraph per stage; then the same step as GRPO-MA's tree (train.py's
default), with one packed row.

    python docs/tour.py [--out docs/tour.md]          # make tour

Nothing here is typed by hand but the paragraphs: the tensors come from running the step (one thread, fixed seeds,
fixed print precision, so the file is the same on every run on one machine), and each line of code is read from
grpo_minimal.py or train.py as it is now. tests/test_grpo_minimal.py regenerates the file and fails if it is stale:
all of it on the machine kind named in its last line (torch version, CPU capability, vendor, vector extensions; other
kernels round differently), its quoted code everywhere else.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "tests"))
import advantage  # noqa: E402
import grpo_minimal as gm  # noqa: E402
import train  # noqa: E402
from helpers import machine  # noqa: E402
from hf import BUNDLED_DIR  # noqa: E402
from pack import pack, per_completion, rollouts  # noqa: E402
from rewards import score_batch  # noqa: E402
from sampler import StopText, sample_tree  # noqa: E402
from tokenizer import decode_completion  # noqa: E402

SEED = 28  # the first seed whose groups all hold a right and a wrong answer, in the plain step and in the tree
CFG = gm.Config(model=BUNDLED_DIR, seed=SEED, prompts_per_step=2, group_size=4, beta=0.04)
K_MA, M_MA, THOUGHT, ANSWER = 2, 2, 64, 16  # the tree: K x M = 4 completions per prompt, as the group above


def code(module, needle: str) -> str:
    """The line of `module`'s source that holds `needle`, as `file:line` and the line, in a code span. A needle
    no longer in the file is an error: the tour must follow the code, not quote a line that is gone."""
    lines, _ = inspect.getsourcelines(module)
    hits = [i for i, line in enumerate(lines) if needle in line]
    if not hits:
        raise SystemExit(f"docs/tour.py: no line of {module.__name__}.py holds {needle!r}; update the tour's needles")
    i = hits[0]
    fn = next((ln.split("(")[0][4:] for ln in reversed(lines[: i + 1]) if ln.startswith("def ")), "")
    where = f"{module.__name__}.py:{i + 1}" if module is gm else f"{module.__name__}.py, in {fn}()"
    return f"{where}\n\n```python\n{lines[i].strip()}\n```\n"


def vals(x: torch.Tensor, n: int = 8) -> str:
    """The first n values of a 1-D tensor, 4 decimals (ints as they are)."""
    items = x.flatten()[:n].tolist()
    text = ", ".join(f"{v:.4f}" if isinstance(v, float) else str(v) for v in items)
    return f"[{text}{', ...' if x.numel() > n else ''}]"


def grid(x: torch.Tensor) -> str:
    """A 2-D tensor, one row a line, 4 decimals."""
    return "\n".join(vals(row, n=row.numel()) for row in x)


def block(*lines: str) -> str:
    return "```\n" + "\n".join(lines) + "\n```\n"


def grpo_section() -> str:
    """One step of grpo_minimal.py, stage by stage."""
    cfg, P = CFG, CFG.prompts_per_step
    policy, reference, tokenizer, task, optimizer = gm.setup(cfg)
    examples, seeds = task.train(P, cfg.seed), [gm.derive_seed(cfg.seed, 0, i) for i in range(P)]
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    made = gm.step(policy, reference, optimizer, tokenizer, task, examples, seeds, cfg)
    rows, c0 = made["rows"], made["completions"][0]
    moved = max((policy.state_dict()[k] - before[k]).abs().max().item() for k in before)
    B, T = rows.mask.shape
    out = [f"## Plain GRPO: one step of grpo_minimal.py\n\nP = {P} prompts, K = {cfg.group_size} completions each "]
    out[-1] += f"(B = {B} rows), beta = {cfg.beta}, seed {cfg.seed}, at most {cfg.max_new_tokens} new tokens.\n"

    out.append("### 0. Prompts\n\n" + code(gm, "prompts = [render_prompt("))
    shown = [f"examples[{i}]: prompt {ex['prompt']!r}, answer {ex['answer']!r}" for i, ex in enumerate(examples)]
    p0 = made["prompts"][0]
    out.append(block(*shown, f"prompts[0]: {len(p0)} ids {p0}", f"as text: {tokenizer.decode(p0)!r}"))
    out.append(
        "The task's examples come from a deterministic stream (`task.train(n, seed)`); the chat template turns each "
        "into token ids. The bundled model's tokenizer is one character a token, so ids and text line up.\n"
    )

    out.append("### 1. Sample: K completions per prompt\n\n" + code(gm, "return generate(policy, prompts, n="))
    lengths = [len(c) for c in made["completions"]]
    out.append(block(f"completions: {B} token lists, lengths {lengths}", f"completions[0]: {c0}"))
    out.append(
        "The sampler prefills each prompt once, forks its KV cache K ways and decodes until a stop token or the "
        "limit. Prompt p's random draws come only from its own seed (`derive_seed(seed, step, p)`), so its "
        "completions do not depend on the batch around it. The list is prompt-major: prompt p's at p*K .. p*K+K-1.\n"
    )

    out.append("### 2. Score: one reward per completion\n\n" + code(gm, "rewards = torch.tensor(score_batch("))
    out.append(
        block(f"texts[0]: {made['texts'][0]!r}", f"rewards {tuple(made['rewards'].shape)}:", grid(made["rewards"]))
    )
    out.append(
        "The reward is a plain function of the completion's text and the example: here 1 when the text after "
        "`</think>` is the sum, else 0. The text stops at the stop token, as the checker reads it.\n"
    )

    out.append("### 3. Advantages: each reward against its group\n\n" + code(gm, "adv = (rewards - rewards.mean("))
    out.append(block(f"adv {tuple(made['adv'].shape)}:", grid(made["adv"])))
    out.append(
        "A = (r - mean r) / (std r + 1e-6) within each prompt's group, with the unbiased std. The group's own "
        "mean is the baseline: no value network. A lone right answer in a group of four gets +1.5 and each wrong "
        "one -0.5; a group whose rewards are all equal gets exactly 0 (set by a mask, not by 0 / eps): no gradient.\n"
    )

    out.append("### 4. Rows: prompt | completion, and each token's advantage and weight\n\n")
    out.append(code(gm, "adv_tok = torch.tensor(") + "\n" + code(gm, "weight = m / (m.sum(-1, keepdim=True)"))
    lens = rows.mask.sum(-1).tolist()
    out.append(
        block(
            f"rows.ids {tuple(rows.ids.shape)}   rows.tokens, .mask, .adv, .weight {B, T}",
            f"completion lengths, shortest first: {lens}",
            f"rows.adv[0]:    {vals(rows.adv[0])}",
            f"rows.weight[0]: {vals(rows.weight[0])} = 1 / ({B} * {lens[0]})",
            f"rows.weight.sum() = {rows.weight.sum().item():.4f}",
        )
    )
    out.append(
        "Every completion token carries its completion's advantage. The weight is the loss normaliser: "
        "1 / (B * length) on each real token, 0 on padding, so the loss is a plain sum that equals the mean over "
        "completions of each completion's token mean (the GRPO paper's aggregation). The rows run shortest first, "
        "the order train.py's micro-batches use, so both trainers add their floats in the same order.\n"
    )

    out.append("### 5. Log-probs, ratio, KL and the loss\n\n" + code(gm, "b, t = rows.mask.nonzero("))
    out.append(code(gm, "h = hidden[b, rows.start[b] + t - 1]") + "\n" + code(gm, "ratio = torch.exp(logp - logp"))
    out.append(code(gm, "kl = torch.exp(d) - d - 1") + "\n" + code(gm, "loss = -(rows.weight * surrogate).sum()"))
    out.append(
        block(
            f"logp {tuple(made['logp'].shape)}, row 0: {vals(made['logp'][0])}",
            f"ratio: min {made['ratio'].min().item():.4f}, max {made['ratio'].max().item():.4f}",
            f"kl: max {made['kl'].max().item():.4f}",
            f"loss = {made['loss']:.6e}",
        )
    )
    out.append(
        "The model runs the rows and returns hidden states; only the completion tokens' states go through "
        "`lm_head`, a slice of the vocabulary at a time (`head_logprobs`), so the (B, L, V) logits never "
        "exist. Token t of a completion is predicted by the position before it. The ratio pi / pi_old is "
        "exactly 1 (one update per batch: pi_old is the current policy) but its gradient is grad log pi. The "
        "KL to the reference is 0 at the first step (the policy is the reference) and grows as the policy "
        "moves. The loss is about 0 too: advantages sum to zero within each group. Its gradient is not: the "
        "sum of A * grad log pi.\n"
    )

    out.append("### 6. Update: clip the gradient norm, one AdamW step\n\n" + code(gm, "grad_norm = torch.nn.utils"))
    out.append(block(f"grad_norm = {made['grad_norm']:.6f}", f"largest weight change: {moved:.3e} (lr = {cfg.lr})"))
    out.append(
        f"The global gradient norm is measured before clipping to {cfg.grad_clip}. train.py logs it as "
        "`grad_norm`, with GRPO-MA's gradient spike score `gss_t = ||g_t|| / mean_{s<=t} ||g_s||` (metrics.py, "
        "advantage.gradient_spike_score): 1 on the first step by definition, and a step with gss above 10 "
        "(counted as `gss10_frac`) is a spike, far above the run's norms so far. AdamW's first step moves each "
        "weight whose gradient is not 0 by about lr, whatever the gradient's size.\n"
    )
    return "\n".join(out)


def grpo_ma_section() -> str:
    """The same prompts as K thoughts x M answers each (train.py --algo grpo_ma), and the first packed row."""
    cfg, P = CFG, CFG.prompts_per_step
    policy, _, tokenizer, task, _ = gm.setup(gm.Config(model=cfg.model))
    examples, seeds = task.train(P, cfg.seed), [gm.derive_seed(cfg.seed, 0, i) for i in range(P)]
    prompts = [gm.render_prompt(tokenizer, ex, task.system_prompt) for ex in examples]
    marker = StopText("</think>", tokenizer.encode("</think>"), tokenizer.decode, tokenizer.vocab_size)
    kw = dict(max_thought_tokens=THOUGHT, max_answer_tokens=ANSWER, end_of_thought=marker, seed=seeds)
    tree = sample_tree(policy, prompts, k=K_MA, m=M_MA, stop_ids=tokenizer.stop_ids, **kw)
    groups = rollouts(examples, prompts, tree, K_MA, M_MA)
    answers = [(g, t, a) for g in groups for t in g.thoughts for a in t.answers]
    texts = [decode_completion(tokenizer, t.tokens + a.tokens) for _, t, a in answers]
    for (_, _, a), r in zip(answers, score_batch(task.reward, texts, [g.example for g, _, _ in answers])):
        a.reward = r
    reward = per_completion(groups, "reward")  # (P, K, M)
    adv_thought, adv_answer = advantage.grpo_ma_advantages(reward)
    batch = pack(groups, tokenizer.pad_id, torch.device("cpu"))
    n_rows = batch.ids.shape[0]
    kw = dict(num_thoughts=n_rows, num_answers=n_rows * M_MA)
    weight = advantage.grpo_ma_token_weights(batch.thought, batch.answer_id, **kw)
    adv = advantage.grpo_ma_token_advantages(adv_thought, adv_answer, batch.thought, batch.answer_id)
    t0 = groups[0].thoughts[0]
    out = [f"## GRPO-MA: the same step as a tree (train.py's default, `--algo grpo_ma`)\n\nThe same {P} prompts "]
    out[-1] += f"and seeds, K = {K_MA} thoughts x M = {M_MA} answers each: again 4 completions a prompt.\n"
    out.append("### Sample the tree\n\n" + code(train, "sample_tree(run.sampler"))
    shown = [f"thought 0 of prompt 0: {tokenizer.decode(t0.tokens)!r}"]
    shown += [f"  answer {j}: {tokenizer.decode(a.tokens)!r}" for j, a in enumerate(t0.answers)]
    out.append(block(*shown, f"rewards {tuple(reward.shape)}:", *(grid(r) for r in reward)))
    out.append(
        "Each prompt is prefilled once and forked K ways; each thought is decoded until its text holds `</think>` "
        "(or the limit: then the marker is appended), its KV cache forked M ways, and M answers decoded from "
        "that exact prefix. A completion is thought + answer; its reward is read from that text as before.\n"
    )
    out.append("### Thought and answer advantages\n\n" + code(advantage, "thought = group_advantages("))
    out.append(code(advantage, "answer = group_advantages(rewards.reshape("))
    answer_adv = [grid(a) for a in adv_answer]
    out.append(
        block(f"thought adv {tuple(adv_thought.shape)}:", grid(adv_thought), "answer adv (P, K, M):", *answer_adv)
    )
    out.append(
        "A thought's value is the mean reward of its M answers, normalised over the prompt's K thoughts; each "
        "answer is normalised over all K*M answers of its prompt. With M = 1 both are GRPO's advantage.\n"
    )
    out.append("### The packed row\n\n" + code(train, "batch = pack(groups,"))
    seg = ["prompt"] + ["thought"] + [f"answer {j}" for j in range(M_MA)]
    L, n_t = len(groups[0].prompt), len(t0.tokens)
    starts = [0, L, L + n_t] + [L + n_t + sum(len(a.tokens) for a in t0.answers[:j]) for j in range(1, M_MA)]
    ends = [*starts[1:], L + n_t + sum(len(a.tokens) for a in t0.answers)]
    attn = batch.packed_attn[0, 0]
    sees = [[("x" if attn[a:b, c:d].any() else ".") for c, d in zip(starts, ends)] for a, b in zip(starts, ends)]
    table = ["| query \\ key | " + " | ".join(seg) + " |", "|---" * (len(seg) + 1) + "|"]
    table += [f"| {s} | " + " | ".join(row) + " |" for s, row in zip(seg, sees)]
    row0 = batch.packed_pos[0, : ends[-1]]
    out.append(
        block(
            f"packed row 0: {ends[-1]} tokens = prompt {L} | thought {n_t} | "
            + " | ".join(f"answer {j} {len(a.tokens)}" for j, a in enumerate(t0.answers)),
            f"RoPE positions, segment starts: {[row0[s].item() for s in starts]}",
            f"logical row 0 (the loss's layout): answer_id {vals(batch.answer_id[0], 48)}",
            f"thought weight {weight[0, 0].item():.6f} = 1 / ({n_rows} thoughts * {n_t} tokens)",
            f"answer 0 weight {weight[0, n_t].item():.6f} = 1 / ({n_rows * M_MA} answers * "
            f"{len(t0.answers[0].tokens)} tokens); adv: thought {adv[0, 0].item():.4f}, answer 0 "
            f"{adv[0, n_t].item():.4f}",
        )
    )
    out.append("Tree attention within the row (x: some query of the row's segment sees some key of the column's):\n")
    out.append("\n".join(table) + "\n\n" + code(train, "advantage.grpo_ma_token_weights("))
    out.append(
        "One row per thought: prompt | thought | answer 1 .. answer M, the thought's tokens once. Every answer's "
        "positions restart where the thought ends, as if it stood alone after the thought, and tree attention "
        "keeps an answer from seeing the others. Thought tokens carry the thought's advantage and count once "
        "(weight 1 / (thoughts * length)); answer tokens carry their own (weight 1 / (answers * length)): the "
        "loss is the mean thought loss plus the mean answer loss. train.py also runs each prompt once for its "
        "K rows (`--share-prompt`); this row holds its prompt, as `--no-share-prompt` would.\n"
    )
    return "\n".join(out)


def tour() -> str:
    """The whole of docs/tour.md."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: a multi-threaded CPU sum may change the last bits from run to run
    try:
        head = (
            "# A tour of one GRPO step\n\nGenerated by `make tour` (docs/tour.py): one step of "
            "[grpo_minimal.py](../grpo_minimal.py) on the bundled tiny model, every tensor the step's own and every "
            "line of code read from the source as it is now. tests/test_grpo_minimal.py regenerates this file and "
            "fails if it is stale, and proves that grpo_minimal.py computes `train.py --algo grpo`'s numbers.\n\n"
            "Its figures come from the machine named at its end (torch version, CPU capability, vendor, vector "
            "extensions): CPU kernels round differently on another kind, so regenerated there they may differ in "
            "the last digits (the 6th, say), while every quoted line of code stays the same.\n"
        )
        # the machine kind whose CPU kernels made the numbers: elsewhere the test checks the quoted code only
        made_on = machine()
        named = f"torch {made_on['torch']}, {made_on['cpu']}, {made_on['vendor']}, {' '.join(made_on['isa'])}"
        kind = f"Figures from: {named}.\n"
        kind += f"<!-- numbers from: {json.dumps(made_on, sort_keys=True)} -->\n"
        return head + "\n" + grpo_section() + "\n" + grpo_ma_section() + "\n" + kind
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "tour.md"), help="where to write the tour")
    path = Path(parser.parse_args().out)
    path.write_text(tour())
    print(f"wrote {path}")
