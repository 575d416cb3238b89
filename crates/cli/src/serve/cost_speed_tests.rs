//! The cost model's speed-up ratio that `serve`'s flags set (embedded engines or given).

use clap::Parser;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    serve: super::ServeArgs,
}

fn ratio(args: &[&str]) -> f64 {
    let cli = Cli::try_parse_from(std::iter::once("serve").chain(args.iter().copied())).unwrap();
    cli.serve
        .config(super::Outputs::CheckOnly)
        .unwrap()
        .router
        .router_cost_speedup_ratio
}

#[test]
fn the_cost_model_runs_at_the_embedded_engines_speed_unless_told() {
    assert_eq!(ratio(&["--worker", "http://127.0.0.1:1"]), 1.0);
    assert_eq!(
        ratio(&["--mock-workers", "2", "--mock-speedup-ratio", "10"]),
        10.0
    );
    assert_eq!(
        ratio(&[
            "--mock-workers",
            "2",
            "--mock-speedup-ratio",
            "10",
            "--router-cost-speedup-ratio",
            "3"
        ]),
        3.0
    );
    let cli = Cli::try_parse_from([
        "serve",
        "--worker",
        "http://127.0.0.1:1",
        "--router-cost-speedup-ratio",
        "0",
    ])
    .unwrap();
    let e = format!(
        "{:#}",
        cli.serve.config(super::Outputs::CheckOnly).unwrap_err()
    );
    assert!(e.contains("--router-cost-speedup-ratio"), "{e}");
}
