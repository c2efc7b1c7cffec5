//! What `hivenet-router` starts with: every flag and file validated
//! ([`crate::config::build`]), and the upgrade hand-over's settings.

use shards::runtime::state::router::RouterConfig;
use shards::runtime::wire::executor::DriverChoice;

/// Validated start-up settings.
pub(crate) struct Startup {
    pub(crate) drain: std::time::Duration,
    pub(crate) policy_sources: hivenet_router::policy_files::PolicySources,
    pub(crate) policies: shards::logic::routing::policy_set::PolicySet,
    pub(crate) store: hivenet_router::store::StoreConfig,
    pub(crate) admin_keys: Vec<[u8; 32]>,
    pub(crate) insecure_admin: bool,
    pub(crate) auth_sources: hivenet_router::auth_files::AuthSources,
    pub(crate) auth: shards::logic::tenancy::auth::AuthConfig,
    /// Path, whether the operator chose it, size cap; `None`: off.
    pub(crate) audit: Option<(std::path::PathBuf, bool, u64)>,
    pub(crate) cfg: RouterConfig,
    pub(crate) plan: Vec<Option<usize>>,
    pub(crate) driver: DriverChoice,
    pub(crate) psk: Option<libp2p_pnet::PreSharedKey>,
    pub(crate) keypair: libp2p_identity::Keypair,
    pub(crate) shared_state: Option<(
        std::sync::Arc<shards::runtime::services::shared_state::SharedState>,
        shards::runtime::services::shared_state::Pending,
    )>,
    /// `--shared-state-affinity`.
    pub(crate) shared_affinity: bool,
    /// `--p2p-announce-addr`.
    pub(crate) announce: Option<crate::go_flags::Announce>,
    /// The upgrade hand-over (issue 54).
    pub(crate) upgrade: UpgradeCfg,
}

/// The upgrade hand-over's settings.
#[derive(Debug, Clone)]
pub(crate) struct UpgradeCfg {
    /// `--upgrade`: take over from the router on `socket`.
    pub(crate) take_over: bool,
    /// `--upgrade-socket`.
    pub(crate) socket: std::path::PathBuf,
    /// The operator named it (else the default beside the store).
    pub(crate) socket_explicit: bool,
    /// `--upgrade-drain-timeout`.
    pub(crate) drain: std::time::Duration,
    /// This binary's path at start (a replaced file keeps its path).
    pub(crate) exe: Option<std::path::PathBuf>,
    /// The arguments a SIGUSR2 replacement gets (this process's, with
    /// `--upgrade`).
    pub(crate) args: Vec<String>,
}

/// The upgrade settings from their flags.
pub(crate) fn upgrade_cfg(
    take_over: bool,
    socket: Option<String>,
    drain: &str,
    store: &hivenet_router::store::StoreConfig,
) -> Result<UpgradeCfg, String> {
    let socket_explicit = socket.is_some();
    let socket = match socket {
        Some(s) if s.is_empty() => return Err("--upgrade-socket: empty path".into()),
        Some(s) => std::path::PathBuf::from(s),
        None => std::path::PathBuf::from(format!("{}.upgrade.sock", store.path.display())),
    };
    let drain = hivenet_router::cli::parse_duration("--upgrade-drain-timeout", drain)?;
    let mut args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--upgrade")
        .collect();
    args.push("--upgrade".into());
    Ok(UpgradeCfg {
        take_over,
        socket,
        socket_explicit,
        drain,
        exe: std::env::current_exe().ok(),
        args,
    })
}
