"""The way back to spot, make-before-break (issue 32): a run that fell back to on-demand (a spot outage,
capacity gone) returns to spot once spot can be had again and the remaining work makes the switch pay.

    back = ReturnToSpot(controller)
    back.poll(attempt, now)      # each poll of an on-demand attempt: True once the spot node is ready

The spot node is provisioned (the run's `--provision-delay`) while the on-demand attempt goes on
training; only when it is ready does the on-demand attempt stop, with an emergency checkpoint on
SIGTERM as any switch, and the spot attempt starts on the ready node at once and resumes from that
checkpoint (handover.py: the make-before-break a deadline's switches use too).

It pays when what the rest of the run saves on spot is more than what the switch costs
(planning/return_to_spot.py `switch_pays`, the rule a supervised cloud run's controller uses too), with
`remaining` the seconds of training left at the attempt's measured step time, `provision` the spot
node's provisioning (the run's `--provision-delay`), `start` this machine's start to a first step as the
on-demand attempt measured it, and `rate` the preemptions per second of spot this run has seen. A switch
that does not pay is said once, with its figures, and the run stays on on-demand.
"""

from __future__ import annotations

from typing import Optional

from skyspot.planning.return_to_spot import Payoff, switch_pays

SPOT_BACK = "spot_back"
"""The handover's reason when it is the way back to spot."""


class ReturnToSpot:
    """One run's way back to spot; the controller asks `poll` at each poll of an on-demand attempt. The spot
    node itself is made ready by the controller's handover (handover.py), as a deadline's switch is."""

    def __init__(self, controller) -> None:
        self.c = controller
        self.declined = False
        """A switch that did not pay was said for this spell of spot capacity (it pays less as the run goes on)."""

    def poll(self, attempt, now: float) -> bool:
        c, handover = self.c, self.c.handover
        if not c.spot_available():
            if handover.pending:
                c.say("spot went again before the spot node was ready; staying on on-demand")
                handover.withdraw(attempt)
            self.declined = False
            return False
        if handover.pending:
            if not handover.ready(attempt, now):
                return False
            c.say(f"spot node ready at step {attempt.step}: the on-demand attempt checkpoints and stops")
            return True
        if self.declined:
            return False
        payoff = self._payoff(attempt, now)
        if payoff is None:
            return False  # no step time measured yet
        fields = {"gain_usd": round(payoff.gain_usd, 6), "cost_usd": round(payoff.cost_usd, 6)}
        if not payoff.pays:
            self.declined = True
            handover.declined(attempt, spot=True, reason=SPOT_BACK, **fields)
            c.say(f"spot is back, but the switch does not pay: {payoff.why}; staying on on-demand")
            return False
        handover.begin(attempt, now, spot=True, reason=SPOT_BACK, **fields)
        c.say(
            f"spot is back: provisioning a spot node in {c.spec.provision_delay:.0f}s while on-demand trains "
            f"(it pays: {payoff.why})"
        )
        return False

    def _payoff(self, attempt, now: float) -> Optional[Payoff]:
        c = self.c
        if attempt.first_step_at is None or attempt.step <= attempt.first_step:
            return None
        step_s = (now - attempt.first_step_at) / (attempt.step - attempt.first_step)
        remaining = max(0, c.spec.total_steps - attempt.step) * step_s
        prices = c.prices()
        if prices is None:
            self.declined = True
            c.say("spot is back, but the snapshot has no price for the simulated instance: staying on on-demand")
            return None
        spot, on_demand = prices
        rate = c.preemptions / c.spot_seconds if c.spot_seconds > 0 else 0.0
        return switch_pays(
            remaining_s=remaining,
            on_demand_usd_h=on_demand,
            spot_usd_h=spot,
            provision_s=c.spec.provision_delay,
            start_s=attempt.first_step_at - attempt.started,
            rate_per_s=rate,
        )
