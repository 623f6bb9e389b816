//! `entrollm plan --plot`: each launch shape's size–latency points and front, and the whole
//! model's size–speed front, as SVG or PNG.
//!
//! Text is laid out (and, in PNG, drawn) with an embedded ASCII subset of DejaVu Sans
//! (`fonts/`, Bitstream Vera licence), so a plot looks the same on a machine with no fonts.

use std::path::Path;
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::file::{write_atomic, CostModel, LaunchTune, PlanFile, TuneFile};
use crate::knapsack::{self, Item};
use crate::TuneError;

static FONT_BYTES: &[u8] = include_bytes!("../fonts/DejaVuSans-subset.ttf");
const FONT: &str = "sans-serif";
const PANEL: (u32, u32) = (600, 420);
/// Budgets swept for the whole-model front.
const SWEEP: usize = 32;
/// The sweep's grid may cost 1 / SWEEP_SHARE of each budget: finer than a pixel of the plot, and
/// each plotted point is a real plan's true size and speed.
const SWEEP_SHARE: u64 = 200;
/// And the sweep's DP tables stay small: the grid is refined only this far.
const SWEEP_CELLS: u64 = 1_000_000;

const GREY: RGBColor = RGBColor(160, 160, 160);
const FRONT: RGBColor = RGBColor(31, 119, 180);
const CHOSEN: RGBColor = RGBColor(214, 39, 40);

fn register_font() -> Result<(), String> {
    static LOADED: OnceLock<Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            plotters::style::register_font(FONT, FontStyle::Normal, FONT_BYTES)
                .map_err(|_| "the embedded font does not load".to_string())
        })
        .clone()
}

/// Draw `tune` (and the choices of `plan`, if given) to `path`, SVG or PNG by its extension.
pub fn plot(tune: &TuneFile, plan: Option<&PlanFile>, path: &Path) -> Result<(), TuneError> {
    let err = |why: String| TuneError::Plot {
        path: path.to_path_buf(),
        why,
    };
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(|e| e.to_ascii_lowercase());
    if tune.launches.is_empty() {
        return Err(err("the tune file has no launches to plot".into()));
    }
    tune.validate()
        .map_err(|why| err(format!("invalid tune file: {why}")))?;
    register_font().map_err(err)?;
    let shapes = shape_groups(tune);
    let panels = shapes.len() + 1;
    let cols = panels.min(3);
    let rows = panels.div_ceil(cols);
    let size = (PANEL.0 * cols as u32, PANEL.1 * rows as u32 + 40);
    let front = model_front(tune);
    let bytes = match ext.as_deref() {
        Some("svg") => {
            let mut svg = String::new();
            {
                let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
                draw(root, tune, plan, &shapes, &front, (rows, cols)).map_err(err)?;
            }
            svg.into_bytes()
        }
        Some("png") => {
            let mut rgb = vec![0u8; size.0 as usize * size.1 as usize * 3];
            {
                let root = BitMapBackend::with_buffer(&mut rgb, size).into_drawing_area();
                draw(root, tune, plan, &shapes, &front, (rows, cols)).map_err(err)?;
            }
            encode_png(&rgb, size).map_err(|e| err(format!("PNG encoding: {e}")))?
        }
        _ => return Err(err("give the plot a .svg or .png name".into())),
    };
    write_atomic(path, &bytes)
}

fn encode_png(rgb: &[u8], (w, h): (u32, u32)) -> Result<Vec<u8>, png::EncodingError> {
    let mut out = Vec::new();
    let mut enc = png::Encoder::new(&mut out, w, h);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    enc.set_compression(png::Compression::Default);
    enc.write_header()?.write_image_data(rgb)?;
    Ok(out)
}

/// Launches grouped by shape key, in the order the shapes first appear.
fn shape_groups(tune: &TuneFile) -> Vec<Vec<&LaunchTune>> {
    let mut groups: Vec<Vec<&LaunchTune>> = Vec::new();
    for l in &tune.launches {
        match groups.iter_mut().find(|g| g[0].shape_key == l.shape_key) {
            Some(g) => g.push(l),
            None => groups.push(vec![l]),
        }
    }
    groups
}

/// The whole model's front: (weight bytes, predicted tok/s) of the knapsack's answer at budgets
/// from the smallest total to the fastest plan's total.
fn model_front(tune: &TuneFile) -> Vec<(u64, f64)> {
    let groups: Vec<Vec<Item>> = tune
        .launches
        .iter()
        .map(|l| {
            l.front()
                .into_iter()
                .map(|i| Item {
                    bytes: l.points[i].bytes,
                    cost: l.points[i].latency_us,
                })
                .collect()
        })
        .collect();
    let overhead = tune.step_overhead_us.unwrap_or(0.0);
    let lo = knapsack::min_bytes(&groups);
    let hi: u64 = groups
        .iter()
        .map(|g| g.last().map_or(0, |it| it.bytes))
        .sum();
    let mut out: Vec<(u64, f64)> = Vec::new();
    for k in 0..SWEEP {
        let budget = lo + ((hi - lo) as f64 * k as f64 / (SWEEP - 1) as f64) as u64;
        if let Ok(s) = knapsack::solve_with(&groups, budget.min(hi), SWEEP_CELLS, SWEEP_SHARE) {
            let point = (s.bytes, 1e6 / (s.cost + overhead));
            // Budgets that buy no speed add no point to the front.
            if out.last().is_none_or(|last| point.1 > last.1) {
                out.push(point);
            }
        }
    }
    out
}

/// A tick label with at most two decimals and no trailing zeros.
fn tick(v: &f64) -> String {
    let s = format!("{v:.2}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" {
        "0".into()
    } else {
        s.into()
    }
}

/// `[lo, hi]` padded by 6 % on each side (and widened when flat).
fn padded(lo: f64, hi: f64) -> std::ops::Range<f64> {
    let span = if hi > lo {
        hi - lo
    } else {
        lo.abs().max(1.0) * 0.1
    };
    (lo - 0.06 * span)..(hi + 0.06 * span)
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    tune: &TuneFile,
    plan: Option<&PlanFile>,
    shapes: &[Vec<&LaunchTune>],
    front: &[(u64, f64)],
    grid: (usize, usize),
) -> Result<(), String> {
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(e)?;
    let title = format!(
        "{} on {} ({} launches)",
        tune.model.path,
        tune.device.name,
        tune.launches.len()
    );
    let root = root.titled(&title, (FONT, 22)).map_err(e)?;
    let areas = root.split_evenly(grid);
    for (area, group) in areas.iter().zip(shapes) {
        draw_shape(area, group, plan).map_err(e)?;
    }
    draw_model(&areas[shapes.len()], tune, plan, front).map_err(e)?;
    if let (Some(plan), Some(area)) = (plan, areas.get(shapes.len() + 1)) {
        draw_summary(area, plan).map_err(e)?;
    }
    root.present().map_err(e)?;
    Ok(())
}

fn draw_shape<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    group: &[&LaunchTune],
    plan: Option<&PlanFile>,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let rep = group[0];
    let mb = |b: u64| b as f64 / 1e6;
    let all = group.iter().flat_map(|l| &l.points);
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for p in all.clone() {
        x0 = x0.min(mb(p.bytes));
        x1 = x1.max(mb(p.bytes));
        y0 = y0.min(p.latency_us);
        y1 = y1.max(p.latency_us);
    }
    let launches = if group.len() == 1 {
        rep.id.clone()
    } else {
        format!("{} launches", group.len())
    };
    let caption = format!("{} {}×{} ({launches})", rep.launch, rep.rows, rep.cols);
    let mut chart = ChartBuilder::on(area)
        .caption(caption, (FONT, 17))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(padded(x0, x1), padded(y0, y1))?;
    chart
        .configure_mesh()
        .x_desc("size (MB)")
        .y_desc("latency (µs)")
        .axis_desc_style((FONT, 14))
        .label_style((FONT, 12))
        .x_label_formatter(&tick)
        .y_label_formatter(&tick)
        .light_line_style(WHITE.mix(0.0))
        .draw()?;
    chart
        .draw_series(
            all.map(|p| Circle::new((mb(p.bytes), p.latency_us), 3, GREY.mix(0.7).filled())),
        )?
        .label("measured forms")
        .legend(|(x, y)| Circle::new((x + 10, y), 3, GREY.filled()));
    let front: Vec<(f64, f64, String)> = rep
        .front()
        .into_iter()
        .map(|i| {
            let p = &rep.points[i];
            let name = if p.variant.is_empty() {
                p.form.clone()
            } else {
                format!("{} {}", p.form, p.variant)
            };
            (mb(p.bytes), p.latency_us, name)
        })
        .collect();
    let front_label = if group.len() == 1 {
        "Pareto front".to_string()
    } else {
        format!("Pareto front of {}", rep.id)
    };
    chart
        .draw_series(LineSeries::new(
            front.iter().map(|(x, y, _)| (*x, *y)),
            FRONT.stroke_width(2),
        ))?
        .label(front_label)
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], FRONT.stroke_width(2)));
    chart.draw_series(
        front
            .iter()
            .map(|(x, y, _)| Circle::new((*x, *y), 4, FRONT.filled())),
    )?;
    // Name the front's points where a name fits without covering another.
    let font = (FONT, 11).into_font().color(&FRONT);
    let mut placed: Vec<(i32, i32, i32, i32)> = Vec::new();
    let (bx, by) = area.get_base_pixel();
    for (x, y, name) in &front {
        let (px, py) = chart.backend_coord(&(*x, *y));
        let (px, py) = (px - bx, py - by);
        let (w, h) = area.estimate_text_size(name, &font)?;
        let (w, h) = (w as i32, h as i32);
        let spot = [
            (px + 6, py - h - 4),
            (px + 6, py + 4),
            (px - w - 6, py - h - 4),
        ]
        .into_iter()
        .find(|&(lx, ly)| {
            placed
                .iter()
                .all(|&(ax, ay, aw, ah)| lx + w < ax || ax + aw < lx || ly + h < ay || ay + ah < ly)
        });
        if let Some((lx, ly)) = spot {
            placed.push((lx, ly, w, h));
            area.draw(&Text::new(name.clone(), (lx, ly), font.clone()))?;
        }
    }
    if let Some(plan) = plan {
        let chosen: Vec<(f64, f64)> = group
            .iter()
            .filter_map(|l| plan.choice(&l.id))
            .map(|c| (mb(c.bytes), c.latency_us))
            .collect();
        if !chosen.is_empty() {
            chart
                .draw_series(
                    chosen
                        .iter()
                        .map(|&(x, y)| Cross::new((x, y), 7, CHOSEN.stroke_width(3))),
                )?
                .label("chosen")
                .legend(|(x, y)| Cross::new((x + 10, y), 6, CHOSEN.stroke_width(3)));
        }
    }
    chart
        .configure_series_labels()
        .label_font((FONT, 12))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .position(SeriesLabelPosition::UpperRight)
        .draw()?;
    Ok(())
}

fn draw_model<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    tune: &TuneFile,
    plan: Option<&PlanFile>,
    front: &[(u64, f64)],
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let gb = |b: u64| b as f64 / 1e9;
    let mut pts: Vec<(f64, f64)> = front.iter().map(|&(b, t)| (gb(b), t)).collect();
    let marked = plan.map(|p| (gb(p.total_bytes), p.predicted_tok_s));
    pts.extend(marked);
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in &pts {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    let y_desc = if tune.step_overhead_us.is_some() {
        "predicted decode (tok/s)"
    } else {
        "predicted decode (tok/s, weights only)"
    };
    let mut chart = ChartBuilder::on(area)
        .caption("whole model: size–speed front", (FONT, 17))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(padded(x0, x1), padded(y0, y1))?;
    chart
        .configure_mesh()
        .x_desc("weights (GB)")
        .y_desc(y_desc)
        .axis_desc_style((FONT, 14))
        .label_style((FONT, 12))
        .x_label_formatter(&tick)
        .y_label_formatter(&tick)
        .light_line_style(WHITE.mix(0.0))
        .draw()?;
    let line: Vec<(f64, f64)> = front.iter().map(|&(b, t)| (gb(b), t)).collect();
    chart
        .draw_series(LineSeries::new(line.iter().copied(), FRONT.stroke_width(2)))?
        .label("fastest plan at each budget")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], FRONT.stroke_width(2)));
    chart.draw_series(
        line.iter()
            .map(|&(x, y)| Circle::new((x, y), 3, FRONT.filled())),
    )?;
    if let Some((x, y)) = marked {
        chart
            .draw_series(std::iter::once(Cross::new(
                (x, y),
                8,
                CHOSEN.stroke_width(3),
            )))?
            .label(format!("plan: {x:.2} GB, {y:.1} tok/s"))
            .legend(|(x, y)| Cross::new((x + 10, y), 6, CHOSEN.stroke_width(3)));
    }
    chart
        .configure_series_labels()
        .label_font((FONT, 12))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .position(SeriesLabelPosition::LowerRight)
        .draw()?;
    Ok(())
}

/// The plan in words, in a free panel.
fn draw_summary<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    plan: &PlanFile,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let gb = |b: u64| format!("{:.2} GB", b as f64 / 1e9);
    let mut lines = vec![
        "plan".to_string(),
        match plan.budget_bytes {
            Some(b) if plan.reserved_bytes > 0 => format!(
                "budget {}, of which {} reserved for KV cache and workspace",
                gb(b),
                gb(plan.reserved_bytes)
            ),
            Some(b) => format!("budget {}", gb(b)),
            None => "no budget: every launch at its fastest".to_string(),
        },
        format!(
            "weights {} in {} launches",
            gb(plan.total_bytes),
            plan.choices.len()
        ),
        format!(
            "predicted {:.1} µs per step, {:.1} tok/s ({} costs)",
            plan.predicted_step_us,
            plan.predicted_tok_s,
            match plan.cost_model {
                CostModel::Measured => "measured",
                CostModel::TuneData => "tune data",
                CostModel::Default => "default",
            }
        ),
    ];
    if let Some(c) = &plan.certificate {
        lines.push(format!(
            "LP bound {:.1} µs, gap {:.2e}",
            c.lp_bound_us, c.gap
        ));
        lines.push(format!(
            "size grid {} B, rounding loss ≤ {:.1} MB",
            c.grid_bytes,
            c.grid_loss_bytes as f64 / 1e6
        ));
    }
    let mut forms: Vec<(String, usize)> = Vec::new();
    for c in &plan.choices {
        let name = format!("{} {}", c.form, c.variant).trim().to_string();
        match forms.iter_mut().find(|(n, _)| *n == name) {
            Some((_, k)) => *k += 1,
            None => forms.push((name, 1)),
        }
    }
    forms.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    lines.push("forms chosen:".to_string());
    let shown = forms.len().min(8);
    for (name, k) in &forms[..shown] {
        lines.push(format!("  {k} × {name}"));
    }
    if forms.len() > shown {
        lines.push(format!("  … and {} more", forms.len() - shown));
    }
    for (i, line) in lines.iter().enumerate() {
        let size = if i == 0 { 17 } else { 14 };
        area.draw(&Text::new(
            line.clone(),
            (30, 20 + 22 * i as i32),
            (FONT, size),
        ))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::file::plan;
    use crate::file::tests::synthetic_tune;
    use std::time::Instant;

    #[test]
    fn draws_svg_and_png_of_a_realistic_tune_file() {
        let tune = synthetic_tune(32);
        let smallest: u64 = tune
            .launches
            .iter()
            .map(|l| l.points.iter().map(|p| p.bytes).min().unwrap())
            .sum();
        let p = plan(&tune, Some(smallest + 2_000_000_000), 1_000_000_000).unwrap();
        // Left in place (overwritten by the next run) so the plots can be looked at.
        let dir = std::env::temp_dir().join("entrollm-tune-plot");
        std::fs::create_dir_all(&dir).unwrap();
        for name in ["front.svg", "front.png", "front-noplan.PNG"] {
            let path = dir.join(name);
            let started = Instant::now();
            let with = if name.contains("noplan") {
                None
            } else {
                Some(&p)
            };
            plot(&tune, with, &path).unwrap();
            eprintln!("{}: {:?}", path.display(), started.elapsed());
            let bytes = std::fs::read(&path).unwrap();
            assert!(bytes.len() > 10_000, "{name}: {} bytes", bytes.len());
            if name.ends_with("svg") {
                let text = String::from_utf8(bytes).unwrap();
                assert!(text.contains("latency (µs)") && text.contains("weights (GB)"));
                assert!(text.contains("plan: "));
            } else {
                assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
            }
        }
        let e = plot(&tune, None, &dir.join("front.pdf"))
            .unwrap_err()
            .to_string();
        assert!(e.contains(".svg or .png"), "{e}");
    }

    #[test]
    fn the_model_front_rises_with_size() {
        let tune = synthetic_tune(4);
        let f = model_front(&tune);
        assert!(f.len() > 5);
        let started = Instant::now();
        let big = model_front(&synthetic_tune(32));
        eprintln!(
            "model front of 130 launches: {:?}, {} points",
            started.elapsed(),
            big.len()
        );
        assert!(
            f.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 < w[1].1),
            "{f:?}"
        );
        assert_eq!(tick(&2.50), "2.5");
        assert_eq!(tick(&3.0), "3");
        assert_eq!(tick(&-0.001), "0");
    }
}
