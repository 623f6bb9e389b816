//! The size–latency Pareto front: the points no other point beats in both bytes and latency.

/// Indices of the Pareto-optimal points of `(bytes, latency)` pairs (both minimised), ordered by
/// bytes ascending, hence latency strictly descending. A point is kept when no other point has
/// bytes ≤ and latency ≤ with one of them strictly smaller; exact duplicates are kept once (the
/// first). Points with a non-finite latency are never on the front.
pub fn pareto_front(points: &[(u64, f64)]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..points.len())
        .filter(|&i| points[i].1.is_finite())
        .collect();
    // By bytes, then latency, then index: the first point of a byte size is its fastest, and
    // among exact duplicates the earliest.
    order.sort_by(|&a, &b| {
        points[a]
            .0
            .cmp(&points[b].0)
            .then(points[a].1.total_cmp(&points[b].1))
            .then(a.cmp(&b))
    });
    let mut front = Vec::new();
    let mut best = f64::INFINITY;
    for i in order {
        // Strictly faster than every smaller-or-equal point: not dominated.
        if points[i].1 < best {
            best = points[i].1;
            front.push(i);
        }
    }
    front
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_only_undominated_points_sorted_by_bytes() {
        let pts = [
            (10, 5.0),
            (20, 3.0),
            (15, 6.0),
            (30, 1.0),
            (25, 3.0),
            (5, 9.0),
        ];
        // (15, 6.0) is beaten by (10, 5.0); (25, 3.0) by (20, 3.0).
        assert_eq!(pareto_front(&pts), vec![5, 0, 1, 3]);
    }

    #[test]
    fn ties_are_kept_once() {
        let pts = [(10, 2.0), (10, 2.0), (10, 1.0), (5, 1.0), (5, 1.0)];
        // (5, 1.0) dominates everything with bytes ≥ 5 and latency ≥ 1; its duplicate goes.
        assert_eq!(pareto_front(&pts), vec![3]);
        let pts = [(7, 3.0), (7, 3.0), (8, 2.0)];
        assert_eq!(pareto_front(&pts), vec![0, 2]);
    }

    #[test]
    fn equal_bytes_keep_the_fastest_and_equal_latency_the_smallest() {
        let pts = [(10, 4.0), (10, 3.0), (12, 3.0), (12, 2.5)];
        assert_eq!(pareto_front(&pts), vec![1, 3]);
    }

    #[test]
    fn empty_single_and_non_finite() {
        assert!(pareto_front(&[]).is_empty());
        assert_eq!(pareto_front(&[(3, 0.0)]), vec![0]);
        let pts = [(1, f64::NAN), (2, 5.0), (3, f64::INFINITY), (0, f64::NAN)];
        assert_eq!(pareto_front(&pts), vec![1]);
    }

    #[test]
    fn matches_the_definition_on_random_points() {
        let mut r = entrollm_codec::rng::SplitMix64::new(1);
        let mut next = || r.next_u64();
        for _ in 0..500 {
            let n = (next() % 12) as usize;
            let pts: Vec<(u64, f64)> = (0..n).map(|_| (next() % 8, (next() % 8) as f64)).collect();
            let front = pareto_front(&pts);
            let dominated = |i: usize| {
                pts.iter().enumerate().any(|(j, q)| {
                    j != i
                        && q.0 <= pts[i].0
                        && q.1 <= pts[i].1
                        && (q.0 < pts[i].0 || q.1 < pts[i].1)
                })
            };
            for i in 0..n {
                let kept = front.contains(&i);
                let first_copy = pts[..i].iter().all(|q| *q != pts[i]);
                assert_eq!(kept, !dominated(i) && first_copy, "{pts:?} {front:?} {i}");
            }
            assert!(front
                .windows(2)
                .all(|w| pts[w[0]].0 < pts[w[1]].0 && pts[w[0]].1 > pts[w[1]].1));
        }
    }
}
