"""methods: one file per paper or method family that extends the plain loop: its flag checks, state, extra step
and metrics (the older files' formulas are still in advantage.py and losses.py). train.py calls each at one seam, and
TrainConfig gathers every file's check(cfg). A reader of the plain algorithm skips a paper by skipping its file.

  hard_examples  choose the data              Hard Examples (arXiv 2508.14094): the hardest rated prompts only
  noise          transform rewards            injected reward noise; noise-corrected GRPO (arXiv 2510.18924)
  dapo           transform rewards, rollouts  DAPO (arXiv 2503.14476): overlong penalty, dynamic sampling
  dagrpo         rollouts, advantages         DaGRPO (arXiv 2512.06337, a reconstruction): anchors, pair mask
  gtpo           advantages and weights       GTPO (arXiv 2508.03772): entropy gate and shift, conflict weights
"""
