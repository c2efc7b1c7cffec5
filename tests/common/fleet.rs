//! A fleet of hosts and sites on one machine (issue 56): each host a Linux
//! network namespace with its own address, the hosts of a site on one
//! bridge, the sites joined by a WAN namespace that routes between them
//! through `scripts/wan-delay.py` (one-way delays per pair of sites, and
//! optional loss: this kernel has no netem). The test process reaches
//! every host directly (no delay) through a link of its own.
//!
//! Needs root, `ip` and python3; when a namespace cannot be made the test
//! fails with the reason, never passes silently.

use super::*;

/// One host: a namespace and its address.
pub struct Host {
    /// The namespace.
    pub ns: String,
    /// Its address.
    pub ip: String,
    /// Its site (1-based).
    pub site: usize,
}

/// The fleet; everything it made is removed on drop.
pub struct Fleet {
    pub hosts: Vec<Host>,
    wan: String,
    root_link: String,
    prefix: String,
    delayer: Option<Child>,
}

fn run(args: &[&str]) -> Result<(), String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| format!("{}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn in_ns(ns: &str, args: &[&str]) -> Result<(), String> {
    let mut all = vec!["ip", "netns", "exec", ns];
    all.extend_from_slice(args);
    run(&all)
}

impl Fleet {
    /// `hosts_per_site[s]` hosts in site `s + 1`; `delays`: one-way
    /// milliseconds between two sites (`(1, 2, 10)`: 10 ms each way,
    /// 20 ms of round trip); `loss`: fraction of inter-site packets dropped.
    /// Panics with the reason when the machine cannot make it.
    pub fn build(hosts_per_site: &[usize], delays: &[(usize, usize, u64)], loss: f64) -> Fleet {
        match Fleet::try_build(hosts_per_site, delays, loss) {
            Ok(f) => f,
            Err(e) => panic!(
                "cannot build the test fleet (root, iproute2 and /dev/net/tun are needed): {e}"
            ),
        }
    }

    fn try_build(
        hosts_per_site: &[usize],
        delays: &[(usize, usize, u64)],
        loss: f64,
    ) -> Result<Fleet, String> {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let id = format!("{:04x}", (std::process::id().wrapping_mul(31) + n) & 0xffff);
        // 10.O.0.0/16: O from the id, so fleets of parallel processes
        // rarely meet (and never within one process).
        let octet = 20 + (u32::from_str_radix(&id, 16).unwrap_or(0) % 200);
        let prefix = format!("10.{octet}");
        let wan = format!("hn{id}w");
        let mut f = Fleet {
            hosts: Vec::new(),
            wan: wan.clone(),
            root_link: format!("hr{id}"),
            prefix: prefix.clone(),
            delayer: None,
        };
        run(&["ip", "netns", "add", &wan])?;
        for k in [
            "net.ipv4.ip_forward=1",
            "net.ipv4.conf.all.rp_filter=0",
            "net.ipv4.conf.default.rp_filter=0",
        ] {
            in_ns(&wan, &["sysctl", "-qw", k])?;
        }
        in_ns(&wan, &["ip", "link", "set", "lo", "up"])?;
        // The test process's own link into the WAN namespace.
        let (rl, wl) = (f.root_link.clone(), format!("hw{id}"));
        run(&[
            "ip", "link", "add", &rl, "type", "veth", "peer", "name", &wl,
        ])?;
        run(&["ip", "link", "set", &wl, "netns", &wan])?;
        run(&[
            "ip",
            "addr",
            "add",
            &format!("{prefix}.250.1/24"),
            "dev",
            &rl,
        ])?;
        run(&["ip", "link", "set", &rl, "up"])?;
        run(&[
            "ip",
            "route",
            "add",
            &format!("{prefix}.0.0/16"),
            "via",
            &format!("{prefix}.250.254"),
        ])?;
        in_ns(
            &wan,
            &[
                "ip",
                "addr",
                "add",
                &format!("{prefix}.250.254/24"),
                "dev",
                &wl,
            ],
        )?;
        in_ns(&wan, &["ip", "link", "set", &wl, "up"])?;
        for (s, count) in hosts_per_site.iter().enumerate() {
            let site = s + 1;
            let br = format!("hb{id}s{site}");
            in_ns(&wan, &["ip", "link", "add", &br, "type", "bridge"])?;
            in_ns(
                &wan,
                &[
                    "ip",
                    "addr",
                    "add",
                    &format!("{prefix}.{site}.254/24"),
                    "dev",
                    &br,
                ],
            )?;
            in_ns(&wan, &["ip", "link", "set", &br, "up"])?;
            for h in 1..=*count {
                let ns = format!("hn{id}s{site}h{h}");
                let ip = format!("{prefix}.{site}.{h}");
                let (outer, inner) = (format!("hv{id}{site}{h}"), format!("he{id}{site}{h}"));
                run(&["ip", "netns", "add", &ns])?;
                f.hosts.push(Host {
                    ns: ns.clone(),
                    ip: ip.clone(),
                    site,
                });
                run(&[
                    "ip", "link", "add", &outer, "type", "veth", "peer", "name", &inner,
                ])?;
                run(&["ip", "link", "set", &outer, "netns", &wan])?;
                run(&["ip", "link", "set", &inner, "netns", &ns])?;
                in_ns(&ns, &["ip", "link", "set", &inner, "name", "eth0"])?;
                in_ns(
                    &ns,
                    &["ip", "addr", "add", &format!("{ip}/24"), "dev", "eth0"],
                )?;
                in_ns(&ns, &["ip", "link", "set", "eth0", "up"])?;
                in_ns(&ns, &["ip", "link", "set", "lo", "up"])?;
                in_ns(
                    &ns,
                    &[
                        "ip",
                        "route",
                        "add",
                        "default",
                        "via",
                        &format!("{prefix}.{site}.254"),
                    ],
                )?;
                in_ns(&wan, &["ip", "link", "set", &outer, "master", &br])?;
                in_ns(&wan, &["ip", "link", "set", &outer, "up"])?;
            }
        }
        if hosts_per_site.len() > 1 {
            f.start_wan(&id, hosts_per_site.len(), delays, loss)?;
        }
        Ok(f)
    }

    /// The delayer on a TUN device of the WAN namespace, and the policy
    /// routes that send every packet between two sites through it.
    fn start_wan(
        &mut self,
        id: &str,
        sites: usize,
        delays: &[(usize, usize, u64)],
        loss: f64,
    ) -> Result<(), String> {
        let tun = format!("ht{id}");
        let mut spec: Vec<String> = delays
            .iter()
            .map(|(a, b, ms)| format!("{a}-{b}={ms}"))
            .collect();
        if loss > 0.0 {
            spec.push(format!("loss={loss}"));
        }
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/wan-delay.py");
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.wan, "python3"])
            .arg(&script)
            .args([&tun, &spec.join(",")])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("wan-delay.py: {e}"))?;
        let mut line = String::new();
        if let Some(out) = child.stdout.as_mut() {
            let mut b = [0u8; 1];
            while !line.ends_with('\n') && out.read(&mut b).map_err(|e| e.to_string())? == 1 {
                line.push(b[0] as char);
            }
        }
        self.delayer = Some(child);
        if line.trim() != "ready" {
            return Err(format!("wan-delay.py did not start: {line:?}"));
        }
        let wan = self.wan.clone();
        in_ns(&wan, &["ip", "link", "set", &tun, "up"])?;
        in_ns(
            &wan,
            &["sysctl", "-qw", &format!("net.ipv4.conf.{tun}.rp_filter=0")],
        )?;
        for s in 1..=sites {
            let table = (100 + s).to_string();
            in_ns(
                &wan,
                &[
                    "ip",
                    "rule",
                    "add",
                    "iif",
                    &format!("hb{id}s{s}"),
                    "lookup",
                    &table,
                ],
            )?;
            for t in (1..=sites).filter(|t| *t != s) {
                let net = format!("{}.{t}.0/24", self.prefix);
                in_ns(
                    &wan,
                    &["ip", "route", "add", &net, "dev", &tun, "table", &table],
                )?;
            }
        }
        Ok(())
    }

    /// Start workspace binary `name` on host `h`.
    pub fn spawn(
        &self,
        h: usize,
        name: &str,
        args: &[&str],
        dir: &Path,
        env: &[(&str, &str)],
    ) -> Proc {
        self.spawn_path(h, &bin(name), args, dir, env)
    }

    /// Start the program at `path` on host `h`, its output in `dir`.
    pub fn spawn_path(
        &self,
        h: usize,
        path: &Path,
        args: &[&str],
        dir: &Path,
        env: &[(&str, &str)],
    ) -> Proc {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        let log = dir.join(format!("{name}-h{h}-{}.log", free_port()));
        let f = std::fs::File::create(&log).expect("log file");
        let f2 = f.try_clone().expect("clone");
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.hosts[h].ns])
            .arg(path)
            .args(args)
            .current_dir(dir)
            .stdout(Stdio::from(f))
            .stderr(Stdio::from(f2))
            .env("RUST_LOG", "info");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {name} on host {h}: {e}"));
        Proc { child, name, log }
    }

    /// `ip:port` of host `h`.
    pub fn addr(&self, h: usize, port: u16) -> String {
        format!("{}:{port}", self.hosts[h].ip)
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        if let Some(mut d) = self.delayer.take() {
            let _ = d.kill();
            let _ = d.wait();
        }
        for h in &self.hosts {
            let _ = run(&["ip", "netns", "del", &h.ns]);
        }
        let _ = run(&["ip", "netns", "del", &self.wan]);
        let _ = run(&["ip", "link", "del", &self.root_link]);
    }
}
