//! `hivenet-bench`: thin main over `bench::run`.
#![forbid(unsafe_code)]

fn main() {
    let args: Vec<String> = std::env::args().collect();
    shards::exit_on_version_flag("hivenet-bench", &args);
    let cmd = args.first().cloned().unwrap_or_default();
    let norm: Vec<String> = args
        .iter()
        .skip(1)
        .flat_map(|a| match a.split_once('=') {
            Some((k, v)) if a.starts_with("--") => vec![k.to_string(), v.to_string()],
            _ => vec![a.clone()],
        })
        .collect();
    let refs: Vec<&str> = norm.iter().map(String::as_str).collect();
    let opts = match <bench::Opts as argh::FromArgs>::from_args(&[cmd.as_str()], &refs) {
        Ok(o) => o,
        Err(e) => {
            if e.status.is_ok() {
                println!("{}", e.output);
                return;
            }
            eprintln!("{}", e.output.trim_end());
            std::process::exit(2);
        }
    };
    match bench::run(&opts) {
        Ok(r) => {
            print!("{}", bench::report::table(&r));
            println!("report: {}", opts.out);
        }
        Err(e) => {
            eprintln!("hivenet-bench: {e}");
            std::process::exit(2);
        }
    }
}
