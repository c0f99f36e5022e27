"""How many drafts a request's next step may verify, adapted to how its drafts fare.

A rejected draft costs the compute of a token (on a CPU about an eighth of a decode step's
worth; less on a GPU at small batch, where decoding is memory-bound; more at large batch),
and a proposer that keeps guessing wrong for a request (n-gram lookup in text that only
looks repetitive) would make it pay for ``num_speculative_tokens`` of them every step. So
each request keeps a budget:

* after a step that kept every draft, twice as many (up to ``num_speculative_tokens``);
* after one that missed, one more than it kept;
* while the share of drafts it keeps (an average over its recent steps) is below
  ``MIN_ACCEPTANCE``, none: for 2 steps, then one draft to probe, and if that misses too
  for 4, 8 .. 32 steps. A kept draft lifts the average and ends the pauses.

Torch-free; it lives on the request (``Request.draft_budget``).
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_ACCEPTANCE = 0.2
ACCEPTANCE_WEIGHT = 0.3  # of the latest step in the running average
MAX_PAUSE_STEPS = 32


@dataclass(slots=True)
class DraftBudget:
    allowed: int  # drafts the next step may verify
    acceptance: float = 1.0  # running average of the share of drafts kept per step
    paused_steps: int = 0  # steps left without drafts
    num_pauses: int = 0  # pauses in a row, each twice the last

    def take(self) -> int:
        """The drafts this step may verify (0 while paused; counts the pause down)."""
        if self.paused_steps:
            self.paused_steps -= 1
            return 0
        return self.allowed

    def update(self, num_drafts: int, num_kept: int, max_drafts: int) -> None:
        """A step verified ``num_drafts`` drafts and kept ``num_kept`` of them."""
        if num_kept == num_drafts:
            self.allowed = min(max_drafts, 2 * num_drafts)
        else:
            self.allowed = min(max_drafts, num_kept + 1)
        rate = num_kept / num_drafts
        self.acceptance += ACCEPTANCE_WEIGHT * (rate - self.acceptance)
        if self.acceptance >= MIN_ACCEPTANCE:
            self.num_pauses = 0
            return
        self.paused_steps = min(MAX_PAUSE_STEPS, 2 << self.num_pauses)
        self.num_pauses += 1
