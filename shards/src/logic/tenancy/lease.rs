//! Quota leases (escrow) for several routers sharing one quota (issue 31),
//! pure: what a router may spend from the lease it holds, and what it
//! draws next.
//!
//! A router draws units (requests, or tokens) from the global quota in
//! Redis in the background and spends them locally, so the request path
//! never waits on the network. Its balance is what it drew and has not
//! spent; it may go below zero by one *credit* (a request admitted before
//! its draw landed: the first request after a start, a burst between two
//! draws). The credit is the lease, or the request's own need when that is
//! larger (a token request bigger than the lease); it is zero once the
//! global quota said it is exhausted. Every unit spent on credit is
//! charged to the global quota by the next draw, unconditionally (the
//! *debt*), so nothing spent is ever lost from the global count.
//!
//! Over-admission bound: units are admitted beyond the global quota only
//! on credit, at most one credit per router at a time: `routers x
//! max(lease, largest need)`.

/// The request lease of a bucket of `burst` requests: 0.5 % of it, at
/// least 1 (600 a minute: 3; four routers may admit 12 beyond the
/// global bucket, 0.7 % of its first two minutes).
pub fn request_lease(burst: u64) -> i64 {
    i64::try_from((burst / 200).max(1)).unwrap_or(i64::MAX)
}

/// The token lease of a daily budget of `limit` tokens: 0.1 % of it, at
/// least 1.
pub fn token_lease(limit: u64) -> i64 {
    i64::try_from((limit / 1000).max(1)).unwrap_or(i64::MAX)
}

/// The balance after spending `need` units, or `None` when this router
/// must refuse: beyond its credit of one `lease` (zero once the global
/// quota is `exhausted`). A request larger than what the router holds
/// plus one lease reserves a draw first (issue 51 #5: one request of the
/// whole budget per router was admitted on credit, 2.93x over three).
pub fn spend(balance: i64, need: i64, lease: i64, exhausted: bool) -> Option<i64> {
    let credit = if exhausted { 0 } else { lease };
    let after = balance.saturating_sub(need);
    (after >= credit.saturating_neg()).then_some(after)
}

/// The share of what the global quota has left that one router may draw
/// for its pace in one round: a quarter (the others find the rest).
pub const PACE_SHARE: u64 = 4;

/// The balance a router tops up to: one lease, or twice what it spent
/// since the last round when that is more (a busy router then draws for
/// its pace instead of refusing between rounds), but never more of the
/// pace than a quarter of what the global quota said it had `left` at the
/// last draw. A large balance admits nothing beyond the global quota (it
/// was drawn from it), but what a router holds unspent is refused on the
/// others: near the quota's end, the lease shrinks back to one lease so
/// that little stays stranded on a router its clients stopped calling.
pub fn target(lease: i64, spent_last_round: u64, left: u64) -> i64 {
    let pace = spent_last_round.saturating_mul(2).min(left / PACE_SHARE);
    lease.max(i64::try_from(pace).unwrap_or(i64::MAX))
}

/// What the next draw asks of the global quota for a balance of `balance`
/// against a lease of `lease`: the debt, charged whatever the quota has
/// left, and a top-up back to one lease, granted as far as it has room.
/// `(0, 0)`: nothing to draw.
pub fn draw(balance: i64, lease: i64) -> (i64, i64) {
    let debt = balance.min(0).saturating_neg();
    let top_up = lease.saturating_sub(balance.max(0)).max(0);
    // A balance above half the lease waits for the next round: fewer
    // round trips at low rates.
    if debt == 0 && balance.saturating_mul(2) > lease {
        return (0, 0);
    }
    (debt, top_up)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn sizes() {
        assert_eq!(request_lease(600), 3);
        assert_eq!(request_lease(10), 1);
        assert_eq!(request_lease(0), 1);
        assert_eq!(token_lease(100_000), 100);
        assert_eq!(token_lease(5), 1);
    }

    #[test]
    fn credit_is_one_lease_or_one_request_and_none_once_exhausted() {
        assert_eq!(spend(0, 1, 3, false), Some(-1));
        assert_eq!(spend(-2, 1, 3, false), Some(-3));
        assert_eq!(spend(-3, 1, 3, false), None);
        assert_eq!(spend(-3, 1, 3, true), None);
        assert_eq!(spend(1, 1, 3, true), Some(0));
        assert_eq!(spend(0, 1, 3, true), None);
        // A request bigger than the lease may take its own size on credit
        // from a balance at zero or above, never on top of a debt.
        // Larger than the lease: not on credit (it reserves a draw).
        assert_eq!(spend(0, 500, 100, false), None);
        assert_eq!(spend(400, 500, 100, false), Some(-100));
        assert_eq!(spend(-1, 500, 100, false), None);
        assert_eq!(spend(499, 500, 100, true), None);
        assert_eq!(spend(500, 500, 100, true), Some(0));
    }

    #[test]
    fn a_busy_router_tops_up_for_its_pace() {
        assert_eq!(target(3, 0, u64::MAX), 3);
        assert_eq!(target(3, 1, u64::MAX), 3);
        assert_eq!(target(3, 10, u64::MAX), 20);
        assert_eq!(draw(-3, target(3, 10, u64::MAX)), (3, 20));
    }

    #[test]
    fn the_pace_draws_at_most_a_quarter_of_what_is_left() {
        // 19 left: the pace of 4 a round (target 8) draws 4.
        assert_eq!(target(1, 4, 19), 4);
        // Near the end, one lease whatever the pace.
        assert_eq!(target(1, 4, 2), 1);
        assert_eq!(target(3, 50, 0), 3);
        assert_eq!(target(3, 50, 100), 25);
    }

    #[test]
    fn draws_repay_the_debt_and_top_up() {
        assert_eq!(draw(-3, 3), (3, 3));
        assert_eq!(draw(0, 3), (0, 3));
        assert_eq!(draw(1, 3), (0, 2));
        assert_eq!(draw(2, 3), (0, 0));
        assert_eq!(draw(3, 3), (0, 0));
        assert_eq!(draw(7, 3), (0, 0));
    }

    proptest! {
        /// Spending and drawing in any order: what was spent beyond what
        /// the global quota granted never exceeds one credit (the bound
        /// the docs state), and every unit spent is charged by the next
        /// draw (nothing lost).
        #[test]
        fn over_admission_is_at_most_one_credit(
            lease in 1i64..50,
            ops in proptest::collection::vec((any::<bool>(), 1i64..80, 0i64..100), 1..300),
        ) {
            let mut balance = 0i64;
            let mut quota_left = 200i64;
            let mut charged = 0i64;
            let mut spent = 0i64;
            let mut exhausted = false;
            let mut largest = 0i64;
            for (is_draw, need, _) in ops {
                if is_draw {
                    let (debt, top) = draw(balance, lease);
                    let granted = top.min(quota_left.max(0));
                    quota_left -= debt + granted;
                    charged += debt + granted;
                    balance += debt + granted;
                    exhausted = granted < top;
                } else if let Some(b) = spend(balance, need, lease, exhausted) {
                    balance = b;
                    spent += need;
                    largest = largest.max(need);
                }
                // Spent = charged - balance: nothing lost, nothing twice.
                prop_assert_eq!(spent, charged - balance);
                prop_assert!(-balance <= lease.max(largest));
            }
            let (debt, _) = draw(balance, lease);
            prop_assert_eq!(charged + debt, spent + balance.max(0));
        }
    }
}
