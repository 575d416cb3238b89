//! Running `kvrouter sim`'s configurations: one simulation each (numbered Perfetto traces
//! beside), the planner's fixed-fleet baseline, and the summary and report written to `--out`.

use super::*;

/// `PATH` for one configuration, `PATH-N.ext` for the N-th of several.
fn numbered(path: &std::path::Path, n: usize, of: usize) -> PathBuf {
    if of <= 1 {
        return path.to_path_buf();
    }
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("trace");
    let ext = path.extension().and_then(|s| s.to_str()).unwrap_or("json");
    path.with_file_name(format!("{stem}-{n}.{ext}"))
}

pub(crate) fn run_one(
    config: SimConfig,
    workload: &Workload,
    quiet: bool,
    perfetto: Option<&std::path::Path>,
) -> anyhow::Result<Summary> {
    let started = Instant::now();
    let name = config.name.clone();
    let mut sim = Simulation::new(config, workload)?;
    let mut events = 0u64;
    let mut last_report = started;
    while sim.step()? {
        events += 1;
        if !quiet
            && events % 8192 == 0
            && last_report.elapsed().as_millis() >= 250
            && started.elapsed().as_secs_f64() > 1.0
        {
            let (done, total) = sim.progress();
            let width = 30;
            let filled = (done * width / total.max(1)).min(width);
            eprint!(
                "\r[{name}] [{}{}] {done}/{total} requests, sim time {:.0} s",
                "#".repeat(filled),
                ".".repeat(width - filled),
                sim.now().as_secs_f64()
            );
            let _ = std::io::stderr().flush();
            last_report = Instant::now();
        }
    }
    if !quiet && started.elapsed().as_secs_f64() > 1.0 {
        eprintln!();
    }
    let wall = started.elapsed().as_secs_f64();
    if let Some(path) = perfetto {
        let file = std::fs::File::create(path)
            .with_context(|| format!("--perfetto {}: cannot create", path.display()))?;
        kvrouter_sim::perfetto::write(
            std::io::BufWriter::new(file),
            sim.workload(),
            sim.records(),
            sim.update_spans(),
        )
        .with_context(|| format!("--perfetto {}: cannot write", path.display()))?;
    }
    let mut summary = finish(sim)?;
    summary.sim_wall_s = (wall * 1000.0).round() / 1000.0;
    Ok(summary)
}

fn finish(sim: Simulation<'_>) -> anyhow::Result<Summary> {
    Ok(sim.run()?)
}

pub(crate) fn run(args: SimArgs) -> anyhow::Result<()> {
    if args.clusters.is_some() {
        return crate::sim_global::run(&args);
    }
    // The flags only the global simulation reads are refused without it, not ignored (and the
    // flags it does not read are refused with it, by clap: `conflicts_with = "clusters"`).
    if args.global_policy != crate::sim::DEFAULT_GLOBAL_POLICIES {
        anyhow::bail!("--global-policy compares global policies: it needs --clusters FILE");
    }
    let workload = args.workload()?;
    let configs = args.configs()?;
    crate::outputs::check_dir(&args.out, "--out")?;
    if let Some(p) = &args.perfetto {
        for n in 0..configs.len() {
            let file = numbered(p, n, configs.len());
            crate::outputs::check_not_out(&file, &args.out)?;
            crate::outputs::check_file(&file, "--perfetto")?;
        }
    }
    for warning in args.unread_warnings(&configs)? {
        tracing::warn!("{warning}");
    }
    let mut runs = Vec::with_capacity(configs.len());
    let count = configs.len();
    for (n, config) in configs.into_iter().enumerate() {
        let trace = args.perfetto.as_deref().map(|p| numbered(p, n, count));
        let fixed = config.planner.is_some().then(|| config.clone());
        let mut run = run_one(config, &workload, args.quiet, trace.as_deref())?;
        if let (Some(base), Some(fleet)) = (fixed, run.fleet.as_mut()) {
            // The fleet sized for the planner's peak, fixed, on the same workload.
            let workers = (fleet.peak_workers as usize).max(1);
            let baseline = SimConfig {
                name: format!("fixed-{workers}"),
                workers,
                planner: None,
                ..base
            };
            let b = run_one(baseline, &workload, args.quiet, None)?;
            fleet.baseline = Some(FleetBaseline::against(
                &b,
                fleet.gpu_seconds,
                run.rl.as_ref(),
            ));
            runs.push(run);
            runs.push(b);
            continue;
        }
        runs.push(run);
    }
    std::fs::create_dir_all(&args.out).with_context(|| format!("--out {}", args.out.display()))?;
    let summary = serde_json::to_string_pretty(&runs)? + "\n";
    std::fs::write(args.out.join("summary.json"), summary)
        .with_context(|| format!("--out {}", args.out.display()))?;
    std::fs::write(
        args.out.join("report.html"),
        kvrouter_sim::report::render_with(&runs, &args.report_parameters()),
    )?;
    print_table(&runs);
    print_fleet(&runs);
    println!(
        "wrote {} and {}",
        args.out.join("summary.json").display(),
        args.out.join("report.html").display()
    );
    Ok(())
}
