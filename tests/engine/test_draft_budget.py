"""The per-request draft budget: grows while drafts are kept, shrinks when they miss, and
pauses speculation for a request whose drafts keep missing."""

from __future__ import annotations

from engine.draft_budget import MAX_PAUSE_STEPS, DraftBudget


def test_grows_while_kept_and_shrinks_on_a_miss():
    budget = DraftBudget(allowed=1)
    allowed = []
    for _ in range(4):
        num_drafts = budget.take()
        budget.update(num_drafts, num_drafts, max_drafts=6)
        allowed.append(budget.allowed)
    assert allowed == [2, 4, 6, 6]
    budget.update(6, 2, max_drafts=6)
    assert budget.take() == 3  # one more than it kept
    assert budget.paused_steps == 0


def test_drafts_that_keep_missing_pause_with_doubling_pauses():
    budget = DraftBudget(allowed=4)
    schedule = []  # drafts offered per step
    for _ in range(120):
        num_drafts = budget.take()
        schedule.append(num_drafts)
        if num_drafts:
            budget.update(num_drafts, 0, max_drafts=4)
    first_pause = schedule.index(0)
    assert schedule[:first_pause] == [4] + [1] * (first_pause - 1)  # the average falls
    pauses, run = [], 0
    for num_drafts in schedule[first_pause:]:
        if num_drafts == 0:
            run += 1
        elif run:
            pauses.append(run)
            run = 0
    assert pauses[:5] == [2, 4, 8, 16, 32]
    assert set(pauses[5:]) == {MAX_PAUSE_STEPS}
    assert sum(1 for n in schedule if n) < 15  # 120 steps, a handful of them drafting
    # One kept draft lifts the average back and ends the pauses.
    while budget.take() == 0:
        pass
    budget.update(1, 1, max_drafts=4)
    budget.update(2, 2, max_drafts=4)
    assert budget.paused_steps == 0 and budget.num_pauses == 0
    assert budget.take() == 4


def test_half_right_guesses_keep_speculating():
    budget = DraftBudget(allowed=2)
    offered = 0
    for step in range(200):
        num_drafts = budget.take()
        offered += num_drafts > 0
        if num_drafts:
            budget.update(num_drafts, num_drafts if step % 2 else 0, max_drafts=2)
    assert offered == 200
