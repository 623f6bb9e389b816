//! The multiple-choice knapsack (MINE §4.2): one group per launch, one choice per form; pick exactly
//! one choice per group so that the total cost (predicted latency) is least and the total bytes fit
//! the budget.
//!
//! Solved by dynamic programming over a size grid. Each choice's bytes above its group's smallest
//! choice are rounded *up* to the grid, so a plan the DP accepts never exceeds the budget in true
//! bytes; the grid is the finest that keeps the table within [`MAX_CELLS`] cells, and never coarser
//! than 0.1 % of the budget spread over the groups, so the rounding costs at most
//! `grid_loss_bytes` (≤ 0.1 % of the budget): every plan whose true total is at most
//! `budget − grid_loss_bytes` was in the DP's reach, and the answer is no slower than the best of
//! them. The LP relaxation (Sinha–Zoltners convex-hull greedy) gives a lower bound on the optimum
//! at the budget itself; `gap` certifies how far from optimal the answer can be.

use crate::front::pareto_front;
use crate::TuneError;

/// One way to store a launch: its bytes and its cost (predicted latency, µs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Item {
    pub bytes: u64,
    pub cost: f64,
}

/// The chosen combination and its certificate.
#[derive(Clone, Debug, PartialEq)]
pub struct Solution {
    /// Index of the chosen item in each group.
    pub picks: Vec<usize>,
    /// True total bytes of the picks; never above the budget.
    pub bytes: u64,
    /// Total cost of the picks.
    pub cost: f64,
    /// LP-relaxation lower bound on the least total cost within the budget.
    pub lp_bound: f64,
    /// `(cost − lp_bound) / lp_bound` (0 when they are equal).
    pub gap: f64,
    /// The size grid the DP ran on, bytes (1: exact).
    pub grid_bytes: u64,
    /// Bytes the rounding may have cost: the answer is at least as fast as every combination of
    /// true total ≤ `budget − grid_loss_bytes`.
    pub grid_loss_bytes: u64,
}

/// The DP table's size limit (cells = choices × grid steps), which bounds time and memory; the
/// grid is refined down to exact bytes whenever the table fits.
pub const MAX_CELLS: u64 = 30_000_000;

/// The rounding may cost at most 1 / GRID_SHARE of the budget.
pub(crate) const GRID_SHARE: u64 = 1000;

/// Pick one item per group with the least total cost whose total bytes fit `budget`.
pub fn solve(groups: &[Vec<Item>], budget: u64) -> Result<Solution, TuneError> {
    solve_with(groups, budget, MAX_CELLS, GRID_SHARE)
}

/// Per group, its Pareto choices (original indices, bytes ascending, cost strictly descending).
fn fronts(groups: &[Vec<Item>]) -> Result<Vec<Vec<usize>>, TuneError> {
    let mut fronts = Vec::with_capacity(groups.len());
    for (g, items) in groups.iter().enumerate() {
        if items.is_empty() {
            return Err(TuneError::EmptyGroup { group: g });
        }
        if let Some((j, it)) = items
            .iter()
            .enumerate()
            .find(|(_, it)| !(it.cost.is_finite() && it.cost >= 0.0))
        {
            return Err(TuneError::BadCost {
                group: g,
                choice: j,
                cost: it.cost,
            });
        }
        let pts: Vec<(u64, f64)> = items.iter().map(|it| (it.bytes, it.cost)).collect();
        let front = pareto_front(&pts);
        if front.len() > u16::MAX as usize {
            return Err(TuneError::TooManyChoices {
                group: g,
                count: front.len(),
            });
        }
        fronts.push(front);
    }
    Ok(fronts)
}

fn min_total(groups: &[Vec<Item>], fronts: &[Vec<usize>]) -> u128 {
    groups
        .iter()
        .zip(fronts)
        .map(|(items, f)| items[f[0]].bytes as u128)
        .sum()
}

/// The smallest total bytes any combination of `groups` has (each group at its smallest choice).
pub fn min_bytes(groups: &[Vec<Item>]) -> u64 {
    let total: u128 = groups
        .iter()
        .map(|items| items.iter().map(|it| it.bytes).min().unwrap_or(0) as u128)
        .sum();
    total.min(u64::MAX as u128) as u64
}

pub(crate) fn solve_with(
    groups: &[Vec<Item>],
    budget: u64,
    max_cells: u64,
    grid_share: u64,
) -> Result<Solution, TuneError> {
    let fronts = fronts(groups)?;
    let min = min_total(groups, &fronts);
    if min > budget as u128 {
        return Err(TuneError::Infeasible {
            min_bytes: min.min(u64::MAX as u128) as u64,
            budget,
            reserved: 0,
        });
    }
    let (lp, _) = lp_greedy(groups, &fronts, budget);
    let finish = |picks: Vec<usize>, grid_bytes: u64, grid_loss_bytes: u64| {
        let bytes: u128 = picks
            .iter()
            .zip(groups)
            .map(|(&j, items)| items[j].bytes as u128)
            .sum();
        assert!(bytes <= budget as u128, "knapsack exceeded its budget");
        let cost: f64 = picks
            .iter()
            .zip(groups)
            .map(|(&j, items)| items[j].cost)
            .sum();
        // The bound and the cost are sums in different orders; rounding must not make the
        // certificate claim better than optimal.
        let lp_bound = lp.min(cost);
        let gap = if cost <= lp_bound {
            0.0
        } else if lp_bound > 0.0 {
            (cost - lp_bound) / lp_bound
        } else {
            f64::INFINITY
        };
        Solution {
            picks,
            bytes: bytes as u64,
            cost,
            lp_bound,
            gap,
            grid_bytes,
            grid_loss_bytes,
        }
    };

    // Everything at its fastest fits: that is the optimum, no DP needed.
    let max: u128 = groups
        .iter()
        .zip(&fronts)
        .map(|(items, f)| items[*f.last().unwrap()].bytes as u128)
        .sum();
    if max <= budget as u128 {
        let picks = fronts.iter().map(|f| *f.last().unwrap()).collect();
        return Ok(finish(picks, 1, 0));
    }

    // Only groups with a real choice enter the DP; the rest take their single front point.
    let multi: Vec<usize> = (0..groups.len()).filter(|&g| fronts[g].len() > 1).collect();
    let spare = budget - min as u64;
    let cells_per_step: u64 = multi.iter().map(|&g| fronts[g].len() as u64).sum();
    let unit_max = (budget / (grid_share * multi.len() as u64)).max(1);
    let unit_fit = ((cells_per_step as u128 * spare as u128).div_ceil(max_cells.max(1) as u128))
        .min(u64::MAX as u128) as u64;
    let unit = unit_fit.clamp(1, unit_max);

    // Weights in grid units above each group's smallest choice, rounded up.
    let weights: Vec<Vec<u64>> = multi
        .iter()
        .map(|&g| {
            let f = &fronts[g];
            let base = groups[g][f[0]].bytes;
            f.iter()
                .map(|&j| (groups[g][j].bytes - base).div_ceil(unit))
                .collect()
        })
        .collect();
    let span: u64 = weights.iter().map(|w| *w.last().unwrap()).sum();
    let cap = (spare / unit).min(span) as usize;
    let costs: Vec<Vec<f64>> = multi
        .iter()
        .map(|&g| fronts[g].iter().map(|&j| groups[g][j].cost).collect())
        .collect();

    let chosen = if fronts.iter().all(|f| f.len() <= 256) {
        dp::<u8>(&weights, &costs, cap)
    } else {
        dp::<u16>(&weights, &costs, cap)
    };
    let mut picks: Vec<usize> = fronts.iter().map(|f| f[0]).collect();
    for (k, &g) in multi.iter().enumerate() {
        picks[g] = fronts[g][chosen[k]];
    }
    Ok(finish(picks, unit, multi.len() as u64 * (unit - 1)))
}

/// A choice index stored in the DP's argmin table.
trait Arg: Copy + Default {
    fn of(j: usize) -> Self;
    fn get(self) -> usize;
}
impl Arg for u8 {
    fn of(j: usize) -> Self {
        j as u8
    }
    fn get(self) -> usize {
        self as usize
    }
}
impl Arg for u16 {
    fn of(j: usize) -> Self {
        j as u16
    }
    fn get(self) -> usize {
        self as usize
    }
}

/// DP over capacities `0..=cap` (grid units); `f_i(c)` = least cost of the first `i` groups within
/// capacity `c`. Stage `i` only keeps `c` in `[cap − (weights still to come), min(cap, weights so
/// far)]`: lower capacities are never asked for, and higher ones equal the top. `weights[i][0]` is
/// 0 and the choices are in increasing weight. Returns the chosen choice per group.
fn dp<A: Arg>(weights: &[Vec<u64>], costs: &[Vec<f64>], cap: usize) -> Vec<usize> {
    let n = weights.len();
    let maxw: Vec<usize> = weights
        .iter()
        .map(|w| *w.last().unwrap() as usize)
        .collect();
    let mut after = vec![0usize; n + 1];
    for i in (0..n).rev() {
        after[i] = after[i + 1] + maxw[i];
    }
    let mut args: Vec<(usize, usize, Vec<A>)> = Vec::with_capacity(n);
    let (mut prev, mut lo_p, mut hi_p) = (vec![0.0f64], 0usize, 0usize);
    let mut so_far = 0usize;
    for i in 0..n {
        so_far += maxw[i];
        let lo = cap.saturating_sub(after[i + 1]);
        let hi = cap.min(so_far);
        let mut cur = vec![f64::INFINITY; hi - lo + 1];
        let mut arg = vec![A::default(); hi - lo + 1];
        let top = prev[hi_p - lo_p];
        for (j, (&w, &cost)) in weights[i].iter().zip(&costs[i]).enumerate() {
            let w = w as usize;
            let a = lo.max(w);
            if a > hi {
                continue;
            }
            let tag = A::of(j);
            // Sources inside the previous window.
            let b = hi.min(hi_p + w);
            if a <= b {
                let src = &prev[a - w - lo_p..=b - w - lo_p];
                let dst = &mut cur[a - lo..=b - lo];
                let dst_arg = &mut arg[a - lo..=b - lo];
                for ((d, t), &s) in dst.iter_mut().zip(dst_arg.iter_mut()).zip(src) {
                    let v = s + cost;
                    if v < *d {
                        *d = v;
                        *t = tag;
                    }
                }
            }
            // Sources above the previous window all equal its top.
            let a2 = a.max(hi_p + w + 1);
            if a2 <= hi {
                let v = top + cost;
                for (d, t) in cur[a2 - lo..=hi - lo]
                    .iter_mut()
                    .zip(arg[a2 - lo..=hi - lo].iter_mut())
                {
                    if v < *d {
                        *d = v;
                        *t = tag;
                    }
                }
            }
        }
        args.push((lo, hi, arg));
        prev = cur;
        lo_p = lo;
        hi_p = hi;
    }
    let mut chosen = vec![0usize; n];
    let mut c = cap;
    for i in (0..n).rev() {
        let (lo, hi, arg) = &args[i];
        let c_eff = c.min(*hi);
        let j = arg[c_eff - lo].get();
        chosen[i] = j;
        c = c_eff - weights[i][j] as usize;
    }
    chosen
}

/// The LP relaxation at `budget` by the convex-hull greedy of Sinha and Zoltners: start every
/// group at its smallest choice, then take the steps along each group's lower convex hull in
/// decreasing cost saved per byte, the last one fractionally. Returns the LP optimum (a lower
/// bound on the integral optimum) and the integral combination before the fractional step.
/// Requires the smallest total to fit `budget`.
pub(crate) fn lp_greedy(
    groups: &[Vec<Item>],
    fronts: &[Vec<usize>],
    budget: u64,
) -> (f64, Vec<usize>) {
    struct Step {
        eff: f64,
        group: usize,
        bytes: u64,
        save: f64,
    }
    let mut hulls: Vec<Vec<usize>> = Vec::with_capacity(groups.len());
    let mut steps = Vec::new();
    let mut bound = 0.0;
    let mut left = budget as u128 - min_total(groups, fronts);
    for (g, (items, front)) in groups.iter().zip(fronts).enumerate() {
        let slope = |a: usize, b: usize| {
            (items[b].cost - items[a].cost) / (items[b].bytes - items[a].bytes) as f64
        };
        let mut hull: Vec<usize> = Vec::with_capacity(front.len());
        for &j in front {
            while hull.len() >= 2
                && slope(hull[hull.len() - 2], hull[hull.len() - 1])
                    >= slope(hull[hull.len() - 1], j)
            {
                hull.pop();
            }
            hull.push(j);
        }
        bound += items[hull[0]].cost;
        for w in hull.windows(2) {
            let bytes = items[w[1]].bytes - items[w[0]].bytes;
            let save = items[w[0]].cost - items[w[1]].cost;
            steps.push(Step {
                eff: save / bytes as f64,
                group: g,
                bytes,
                save,
            });
        }
        hulls.push(hull);
    }
    // Within a group efficiencies strictly decrease, so a stable sort keeps each group's steps in
    // hull order.
    steps.sort_by(|a, b| b.eff.total_cmp(&a.eff));
    let mut at = vec![0usize; groups.len()];
    for s in &steps {
        if (s.bytes as u128) <= left {
            left -= s.bytes as u128;
            bound -= s.save;
            at[s.group] += 1;
        } else {
            bound -= s.save * (left as f64 / s.bytes as f64);
            break;
        }
    }
    let picks = hulls.iter().zip(&at).map(|(h, &k)| h[k]).collect();
    (bound, picks)
}

#[cfg(test)]
mod tests {
    use super::*;
    use entrollm_codec::rng::SplitMix64 as Rng;
    use std::time::Instant;

    fn brute(groups: &[Vec<Item>], budget: u64) -> Option<(f64, Vec<usize>)> {
        let mut best: Option<(f64, Vec<usize>)> = None;
        let mut idx = vec![0usize; groups.len()];
        loop {
            let bytes: u64 = idx.iter().zip(groups).map(|(&j, g)| g[j].bytes).sum();
            let cost: f64 = idx.iter().zip(groups).map(|(&j, g)| g[j].cost).sum();
            if bytes <= budget && best.as_ref().is_none_or(|b| cost < b.0) {
                best = Some((cost, idx.clone()));
            }
            let mut k = 0;
            loop {
                if k == groups.len() {
                    return best;
                }
                idx[k] += 1;
                if idx[k] < groups[k].len() {
                    break;
                }
                idx[k] = 0;
                k += 1;
            }
        }
    }

    fn check_picks(groups: &[Vec<Item>], budget: u64, s: &Solution) {
        assert_eq!(s.picks.len(), groups.len());
        let bytes: u64 = s.picks.iter().zip(groups).map(|(&j, g)| g[j].bytes).sum();
        let cost: f64 = s.picks.iter().zip(groups).map(|(&j, g)| g[j].cost).sum();
        assert_eq!(bytes, s.bytes);
        assert!(bytes <= budget, "{bytes} > {budget}");
        assert_eq!(cost, s.cost);
        assert!(s.lp_bound <= s.cost && s.gap >= 0.0);
    }

    #[test]
    fn equals_brute_force_on_small_random_instances() {
        let mut rng = Rng::new(0x2545f4914f6cdd1d);
        let mut infeasible = 0;
        for case in 0..3000 {
            let ng = 1 + rng.below(5) as usize;
            let groups: Vec<Vec<Item>> = (0..ng)
                .map(|_| {
                    (0..1 + rng.below(5))
                        .map(|_| Item {
                            bytes: rng.below(40),
                            // Small integers: many ties and zeros, and sums are exact.
                            cost: rng.below(10) as f64,
                        })
                        .collect()
                })
                .collect();
            let lo: u64 = groups
                .iter()
                .map(|g| g.iter().map(|i| i.bytes).min().unwrap())
                .sum();
            let hi: u64 = groups
                .iter()
                .map(|g| g.iter().map(|i| i.bytes).max().unwrap())
                .sum();
            let budget = (lo + rng.below(hi - lo + 10)).saturating_sub(5);
            match (solve(&groups, budget), brute(&groups, budget)) {
                (Ok(s), Some((best, _))) => {
                    check_picks(&groups, budget, &s);
                    assert_eq!(s.cost, best, "case {case}: {groups:?} budget {budget}");
                    assert_eq!((s.grid_bytes, s.grid_loss_bytes), (1, 0));
                    let (lp, _) = lp_greedy(&groups, &fronts(&groups).unwrap(), budget);
                    assert!(lp <= best + 1e-9, "LP bound {lp} above optimum {best}");
                }
                (Err(TuneError::Infeasible { min_bytes, .. }), None) => {
                    assert_eq!(min_bytes, lo);
                    assert!(lo > budget);
                    infeasible += 1;
                }
                (r, b) => panic!("case {case}: solve {r:?} brute {b:?}"),
            }
        }
        assert!(
            infeasible > 10,
            "the generator should hit infeasible budgets"
        );
    }

    #[test]
    fn coarse_grid_is_within_the_stated_loss_on_small_instances() {
        // A tiny table limit forces a coarse grid; the answer must fit the budget and be no
        // slower than the best combination within budget − grid loss.
        let mut rng = Rng::new(0xdeadbeefcafef00d);
        let mut coarse = 0;
        for case in 0..1000 {
            let ng = 1 + rng.below(4) as usize;
            let groups: Vec<Vec<Item>> = (0..ng)
                .map(|_| {
                    (0..1 + rng.below(5))
                        .map(|_| {
                            let bytes = 1_000_000 + rng.below(1_000_000_000);
                            Item {
                                bytes,
                                cost: 200.0 - bytes as f64 / 1e7 + rng.unit() * 20.0,
                            }
                        })
                        .collect()
                })
                .collect();
            let lo: u64 = groups
                .iter()
                .map(|g| g.iter().map(|i| i.bytes).min().unwrap())
                .sum();
            let hi: u64 = groups
                .iter()
                .map(|g| g.iter().map(|i| i.bytes).max().unwrap())
                .sum();
            let budget = lo + rng.below(hi - lo + 1);
            let s = solve_with(&groups, budget, 64, GRID_SHARE).unwrap();
            check_picks(&groups, budget, &s);
            let best = brute(&groups, budget).unwrap().0;
            assert!(s.cost >= best, "case {case}");
            assert!(s.grid_loss_bytes * GRID_SHARE <= budget);
            if s.grid_bytes > 1 {
                coarse += 1;
            }
            if let Some((reach, _)) = brute(&groups, budget - s.grid_loss_bytes) {
                assert!(s.cost <= reach, "case {case}: {} > {reach}", s.cost);
            }
        }
        assert!(coarse > 500);
    }

    /// Groups shaped like launches: sizes spread over ~2×, latency falling with size, with some
    /// noise so that not every point is on the front.
    fn launches(rng: &mut Rng, n: usize, k: usize) -> Vec<Vec<Item>> {
        (0..n)
            .map(|_| {
                let base = 20_000_000 + rng.below(200_000_000);
                (0..k)
                    .map(|_| {
                        let x = rng.unit();
                        Item {
                            bytes: base + (x * base as f64) as u64,
                            cost: 50.0 * (2.0 - x) * (1.0 + 0.2 * rng.unit()),
                        }
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn large_instances_are_certified_and_within_grid_loss() {
        let mut rng = Rng::new(0x853c49e6748fea9b);
        for round in 0..4 {
            let groups = launches(&mut rng, 210 + 10 * round, 20);
            let fr = fronts(&groups).unwrap();
            let lo = min_bytes(&groups);
            let hi: u64 = groups
                .iter()
                .map(|g| g.iter().map(|i| i.bytes).max().unwrap())
                .sum();
            for t in [0.05, 0.3, 0.6, 0.9] {
                let budget = lo + ((hi - lo) as f64 * t) as u64;
                let started = Instant::now();
                let s = solve(&groups, budget).unwrap();
                let took = started.elapsed();
                check_picks(&groups, budget, &s);
                let (lp, _) = lp_greedy(&groups, &fr, budget);
                assert!(
                    s.cost >= lp * (1.0 - 1e-12),
                    "cost {} below LP {lp}",
                    s.cost
                );
                assert!(s.grid_loss_bytes * GRID_SHARE <= budget);
                // The LP greedy rounded down at budget − grid loss is an integral combination
                // the DP had in reach: the answer is at least as fast.
                let (_, down) = lp_greedy(&groups, &fr, budget - s.grid_loss_bytes);
                let down_cost: f64 = down.iter().zip(&groups).map(|(&j, g)| g[j].cost).sum();
                assert!(
                    s.cost <= down_cost * (1.0 + 1e-12),
                    "{} > {down_cost}",
                    s.cost
                );
                assert!(s.gap < 0.01, "gap {} at t {t}", s.gap);
                eprintln!(
                    "{} groups × 20, budget at {t}: {took:?}, gap {:.2e}, grid {} B, loss {} B",
                    groups.len(),
                    s.gap,
                    s.grid_bytes,
                    s.grid_loss_bytes
                );
            }
        }
    }

    /// A plain DP over exact bytes with no pruning and no windows, to check the fast one at scale.
    fn reference_dp(groups: &[Vec<Item>], budget: u64) -> f64 {
        let cap = budget as usize;
        let mut f = vec![0.0f64; cap + 1];
        for g in groups {
            let mut next = vec![f64::INFINITY; cap + 1];
            for it in g {
                for c in it.bytes as usize..=cap {
                    next[c] = next[c].min(f[c - it.bytes as usize] + it.cost);
                }
            }
            f = next;
        }
        f[cap]
    }

    #[test]
    fn exact_grid_matches_a_plain_dp_at_scale() {
        let mut rng = Rng::new(0x94d049bb133111eb);
        for _ in 0..5 {
            let groups: Vec<Vec<Item>> = (0..200)
                .map(|_| {
                    (0..20)
                        .map(|_| Item {
                            bytes: 10 + rng.below(60),
                            cost: rng.below(1000) as f64,
                        })
                        .collect()
                })
                .collect();
            let lo = min_bytes(&groups);
            let budget = lo + rng.below(3000);
            let s = solve(&groups, budget).unwrap();
            check_picks(&groups, budget, &s);
            assert_eq!(s.grid_bytes, 1);
            assert_eq!(s.cost, reference_dp(&groups, budget));
        }
    }

    #[test]
    fn infeasible_budget_names_the_smallest_total() {
        let groups = vec![
            vec![
                Item {
                    bytes: 100,
                    cost: 1.0,
                },
                Item {
                    bytes: 60,
                    cost: 3.0,
                },
            ],
            vec![Item {
                bytes: 40,
                cost: 2.0,
            }],
        ];
        let err = solve(&groups, 99).unwrap_err();
        assert!(matches!(
            err,
            TuneError::Infeasible {
                min_bytes: 100,
                budget: 99,
                ..
            }
        ));
        assert!(err.to_string().contains("--budget 100"), "{err}");
        let s = solve(&groups, 100).unwrap();
        assert_eq!((s.picks, s.bytes, s.cost), (vec![1, 0], 100, 5.0));
        assert!(matches!(
            solve(&groups, 0),
            Err(TuneError::Infeasible { .. })
        ));
    }

    #[test]
    fn bad_input_is_refused() {
        assert!(matches!(
            solve(
                &[
                    vec![Item {
                        bytes: 1,
                        cost: 1.0
                    }],
                    vec![]
                ],
                10
            ),
            Err(TuneError::EmptyGroup { group: 1 })
        ));
        for cost in [f64::NAN, -1.0, f64::INFINITY] {
            assert!(matches!(
                solve(
                    &[vec![
                        Item {
                            bytes: 1,
                            cost: 1.0
                        },
                        Item { bytes: 1, cost }
                    ]],
                    10
                ),
                Err(TuneError::BadCost {
                    group: 0,
                    choice: 1,
                    ..
                })
            ));
        }
    }

    #[test]
    fn single_choice_groups_ties_and_zero_costs() {
        // No groups at all.
        let s = solve(&[], 0).unwrap();
        assert_eq!((s.picks.len(), s.bytes, s.cost, s.gap), (0, 0, 0.0, 0.0));
        // Only single choices.
        let groups = vec![
            vec![Item {
                bytes: 5,
                cost: 2.0,
            }],
            vec![Item {
                bytes: 7,
                cost: 0.0,
            }],
        ];
        let s = solve(&groups, 12).unwrap();
        assert_eq!(
            (s.picks, s.bytes, s.cost, s.lp_bound),
            (vec![0, 0], 12, 2.0, 2.0)
        );
        // Exact ties: the smaller of equal-cost choices, the first of duplicates.
        let groups = vec![
            vec![
                Item {
                    bytes: 10,
                    cost: 1.0,
                },
                Item {
                    bytes: 8,
                    cost: 1.0,
                },
                Item {
                    bytes: 8,
                    cost: 1.0,
                },
            ],
            vec![
                Item {
                    bytes: 3,
                    cost: 0.0,
                },
                Item {
                    bytes: 1,
                    cost: 0.0,
                },
            ],
        ];
        let s = solve(&groups, 100).unwrap();
        assert_eq!((s.picks, s.bytes, s.cost, s.gap), (vec![1, 1], 9, 1.0, 0.0));
        // Zero-cost fastest choice beside a single-choice group, budget exactly at the optimum.
        let groups = vec![
            vec![
                Item {
                    bytes: 50,
                    cost: 0.0,
                },
                Item {
                    bytes: 10,
                    cost: 4.0,
                },
            ],
            vec![Item {
                bytes: 5,
                cost: 1.0,
            }],
            vec![
                Item {
                    bytes: 30,
                    cost: 0.0,
                },
                Item {
                    bytes: 20,
                    cost: 1.0,
                },
            ],
        ];
        let s = solve(&groups, 75).unwrap();
        assert_eq!((s.picks, s.bytes, s.cost), (vec![0, 0, 1], 75, 2.0));
        let s = solve(&groups, 74).unwrap();
        assert_eq!((s.picks, s.bytes, s.cost), (vec![1, 0, 0], 45, 5.0));
    }
}
