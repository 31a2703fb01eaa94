//! How this process learns its rank, the world size, its device and the
//! 128-byte NCCL unique id; and how the parent spawns local ranks.
//!
//! Sources, first match wins ([`Role::detect`]):
//! 1. **our own child**: `MOE_EP_BENCH_RANK`, `MOE_EP_BENCH_WORLD`,
//!    `MOE_EP_BENCH_LOCAL_RANK`, `MOE_EP_BENCH_UNIQUE_ID` (256 hex chars);
//! 2. **torchrun / torch.distributed**: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//!    `MASTER_ADDR`, `MASTER_PORT` (all required). When torchrun's agent
//!    already serves its store on `MASTER_PORT`
//!    (`TORCHELASTIC_USE_AGENT_STORE=True`), the rendezvous uses
//!    `MASTER_PORT + 1` instead;
//! 3. **Open MPI**: `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`,
//!    `OMPI_COMM_WORLD_LOCAL_RANK`, plus `MASTER_ADDR` / `MASTER_PORT`.
//!    Only when all ranks are on one node (`OMPI_COMM_WORLD_LOCAL_SIZE` equal
//!    to the world size) do missing ones default to `127.0.0.1` / `29500`;
//!    across nodes both must be exported (`mpirun -x MASTER_ADDR -x MASTER_PORT`);
//! 4. **Slurm** (`srun`): `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`,
//!    plus `MASTER_ADDR` and `MASTER_PORT` (both required). Only inside a job
//!    step (`SLURM_STEP_ID` set) with more than one task: a batch script or a
//!    one-task step is treated as "no launcher";
//! 5. **none**: this process is the parent and spawns the ranks itself
//!    ([`spawn_ranks`]).
//!
//! For 2-4 the unique id travels over a small TCP [`rendezvous`]: rank 0
//! makes it and serves it on the address above. `MOE_EP_BENCH_RDZV_ADDR` and
//! `MOE_EP_BENCH_RDZV_PORT` override the address and port for all three.
//!
//! Every rank uses device `local_rank` of its visible devices;
//! `CUDA_VISIBLE_DEVICES` is never changed here.

use std::ffi::{OsStr, OsString};
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::Path;
use std::process::{Child, Command};
use std::thread;
use std::time::{Duration, Instant};

use moe_ep::UniqueId;

/// Size in bytes of an NCCL unique id (`ncclUniqueId`).
pub const UNIQUE_ID_BYTES: usize = 128;
/// Env var set on spawned ranks: global rank.
pub const ENV_RANK: &str = "MOE_EP_BENCH_RANK";
/// Env var set on spawned ranks: world size.
pub const ENV_WORLD: &str = "MOE_EP_BENCH_WORLD";
/// Env var set on spawned ranks: rank on this node (= device index).
pub const ENV_LOCAL_RANK: &str = "MOE_EP_BENCH_LOCAL_RANK";
/// Env var set on spawned ranks: the NCCL unique id, 256 lowercase hex chars.
pub const ENV_UNIQUE_ID: &str = "MOE_EP_BENCH_UNIQUE_ID";
/// Overrides the rendezvous address under torchrun / Open MPI / Slurm.
pub const ENV_RDZV_ADDR: &str = "MOE_EP_BENCH_RDZV_ADDR";
/// Overrides the rendezvous port under torchrun / Open MPI / Slurm.
pub const ENV_RDZV_PORT: &str = "MOE_EP_BENCH_RDZV_PORT";
/// Rendezvous address used by single-node Open MPI runs without `MASTER_ADDR`.
pub const DEFAULT_MASTER_ADDR: &str = "127.0.0.1";
/// Rendezvous port used by single-node Open MPI runs without `MASTER_PORT`.
pub const DEFAULT_MASTER_PORT: u16 = 29500;
/// Total time (60 s) a rank waits for the rendezvous to complete.
pub const RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(60);

/// Which launcher started this rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    /// Spawned by an `ep-bench` parent ([`spawn_ranks`]).
    EpBench,
    /// torchrun / torch.distributed environment.
    Torchrun,
    /// Open MPI (`mpirun`).
    OpenMpi,
    /// Slurm (`srun`).
    Slurm,
}

impl Launcher {
    /// Human-readable name for messages.
    pub fn name(self) -> &'static str {
        match self {
            Launcher::EpBench => "ep-bench",
            Launcher::Torchrun => "torchrun",
            Launcher::OpenMpi => "Open MPI",
            Launcher::Slurm => "Slurm",
        }
    }
}

/// Where the NCCL unique id comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IdSource {
    /// Given by the parent in `MOE_EP_BENCH_UNIQUE_ID`.
    Given([u8; UNIQUE_ID_BYTES]),
    /// To be fetched with [`rendezvous`] on `addr:port` (rank 0 serves it).
    Rendezvous {
        /// Host name or IP of rank 0's node.
        addr: String,
        /// TCP port (1..=65535).
        port: u16,
    },
}

/// Identity of this rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankEnv {
    /// Global rank, `0..world`.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// Rank on this node; the CUDA device index this rank uses.
    pub local_rank: usize,
    /// Ranks on this node, when the launcher says (`LOCAL_WORLD_SIZE`,
    /// `OMPI_COMM_WORLD_LOCAL_SIZE`; the whole world for our own children).
    pub local_world: Option<usize>,
    /// Who started us.
    pub launcher: Launcher,
    /// How to obtain the NCCL unique id; see [`RankEnv::unique_id`].
    pub id: IdSource,
}

impl RankEnv {
    /// CUDA device index to use (= `local_rank`).
    pub fn device(&self) -> usize {
        self.local_rank
    }

    /// Whether this is rank 0 (the only rank that prints results).
    pub fn is_root(&self) -> bool {
        self.rank == 0
    }

    /// The NCCL unique id shared by all ranks. For our own children it is
    /// the one in the environment (`make_id` is not called); otherwise rank 0
    /// calls `make_id` (e.g. `ncclGetUniqueId`) and serves the result to the
    /// others over TCP ([`rendezvous`], bounded by 60 s).
    pub fn unique_id(
        &self,
        make_id: impl FnOnce() -> Result<[u8; UNIQUE_ID_BYTES], String>,
    ) -> Result<[u8; UNIQUE_ID_BYTES], String> {
        match &self.id {
            IdSource::Given(id) => Ok(*id),
            IdSource::Rendezvous { addr, port } => {
                rendezvous(self.rank, self.world, addr, *port, make_id)
            }
        }
    }
}

/// What this process is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Role {
    /// No launcher: spawn the ranks ([`spawn_ranks`]).
    Parent,
    /// One rank of a running world.
    Rank(RankEnv),
}

impl Role {
    /// Reads the process environment (see the module docs for the order).
    pub fn detect() -> Result<Role, String> {
        Role::from_env(|k| std::env::var(k).ok())
    }

    /// Same as [`Role::detect`] with the environment given as a map (tests).
    #[cfg(test)]
    pub fn from_map(env: &std::collections::HashMap<String, String>) -> Result<Role, String> {
        Role::from_env(|k| env.get(k).cloned())
    }

    /// Same as [`Role::detect`] with the environment given as a lookup.
    pub fn from_env(get: impl Fn(&str) -> Option<String>) -> Result<Role, String> {
        let get = |k: &str| get(k).filter(|v| !v.is_empty());
        if [ENV_RANK, ENV_WORLD, ENV_LOCAL_RANK, ENV_UNIQUE_ID]
            .iter()
            .any(|k| get(k).is_some())
        {
            return own_child(&get).map(Role::Rank);
        }
        if ["RANK", "WORLD_SIZE", "LOCAL_RANK"]
            .iter()
            .any(|k| get(k).is_some())
        {
            return torchrun(&get).map(Role::Rank);
        }
        if get("OMPI_COMM_WORLD_RANK").is_some() || get("OMPI_COMM_WORLD_SIZE").is_some() {
            return open_mpi(&get).map(Role::Rank);
        }
        let in_step = get("SLURM_STEP_ID").is_some() || get("SLURM_STEPID").is_some();
        if in_step && get("SLURM_PROCID").is_some() {
            let ntasks = get("SLURM_NTASKS");
            if ntasks.as_deref() != Some("1") {
                return slurm(&get).map(Role::Rank);
            }
        }
        Ok(Role::Parent)
    }
}

/// Required whole-number variable.
fn need_num(get: &impl Fn(&str) -> Option<String>, key: &str, who: &str) -> Result<usize, String> {
    match get(key) {
        None => Err(format!("{who} environment: {key} is not set")),
        Some(v) => v
            .trim()
            .parse::<usize>()
            .map_err(|_| format!("{who} environment: {key}='{v}' is not a whole number")),
    }
}

/// Optional whole-number variable.
fn opt_num(
    get: &impl Fn(&str) -> Option<String>,
    key: &str,
    who: &str,
) -> Result<Option<usize>, String> {
    match get(key) {
        None => Ok(None),
        Some(_) => need_num(get, key, who).map(Some),
    }
}

/// A port number 1..=65535 from variable `key`.
fn parse_port(key: &str, v: &str, who: &str) -> Result<u16, String> {
    match v.trim().parse::<u16>() {
        Ok(p) if p > 0 => Ok(p),
        _ => Err(format!(
            "{who} environment: {key}='{v}' is not a port number (1..=65535)"
        )),
    }
}

/// `rank` and `local_rank` below a non-zero `world`.
fn check_ranks(rank: usize, world: usize, local_rank: usize, who: &str) -> Result<(), String> {
    if world == 0 {
        return Err(format!("{who} environment: world size is 0"));
    }
    if rank >= world {
        return Err(format!(
            "{who} environment: rank {rank} is not below the world size {world}"
        ));
    }
    if local_rank >= world {
        return Err(format!(
            "{who} environment: local rank {local_rank} is not below the world size {world}"
        ));
    }
    Ok(())
}

/// Applies `MOE_EP_BENCH_RDZV_ADDR` / `_PORT` over the launcher's choice.
fn rdzv_override(
    get: &impl Fn(&str) -> Option<String>,
    addr: Option<String>,
    port: Option<u16>,
) -> Result<(Option<String>, Option<u16>), String> {
    let addr = get(ENV_RDZV_ADDR).or(addr);
    let port = match get(ENV_RDZV_PORT) {
        Some(v) => Some(parse_port(ENV_RDZV_PORT, &v, "ep-bench")?),
        None => port,
    };
    Ok((addr, port))
}

/// The variables an ep-bench parent sets on the ranks it spawns.
fn own_child(get: &impl Fn(&str) -> Option<String>) -> Result<RankEnv, String> {
    let who = "ep-bench child";
    let rank = need_num(get, ENV_RANK, who)?;
    let world = need_num(get, ENV_WORLD, who)?;
    let local_rank = need_num(get, ENV_LOCAL_RANK, who)?;
    check_ranks(rank, world, local_rank, who)?;
    let hex = get(ENV_UNIQUE_ID)
        .ok_or_else(|| format!("{who} environment: {ENV_UNIQUE_ID} is not set"))?;
    let id = id_from_hex(&hex).map_err(|e| format!("{who} environment: {ENV_UNIQUE_ID}: {e}"))?;
    Ok(RankEnv {
        rank,
        world,
        local_rank,
        local_world: Some(world),
        launcher: Launcher::EpBench,
        id: IdSource::Given(id),
    })
}

/// torchrun's variables.
fn torchrun(get: &impl Fn(&str) -> Option<String>) -> Result<RankEnv, String> {
    let who = "torchrun";
    let rank = need_num(get, "RANK", who)?;
    let world = need_num(get, "WORLD_SIZE", who)?;
    let local_rank = need_num(get, "LOCAL_RANK", who)?;
    check_ranks(rank, world, local_rank, who)?;
    let local_world = opt_num(get, "LOCAL_WORLD_SIZE", who)?;
    let addr = get("MASTER_ADDR");
    let mut port = match get("MASTER_PORT") {
        Some(v) => Some(parse_port("MASTER_PORT", &v, who)?),
        None => None,
    };
    // torchrun's agent may already serve its TCPStore on MASTER_PORT.
    if get("TORCHELASTIC_USE_AGENT_STORE").as_deref() == Some("True")
        && get(ENV_RDZV_PORT).is_none()
    {
        port = match port {
            Some(p) => Some(p.checked_add(1).ok_or_else(|| {
                format!("{who} environment: MASTER_PORT={p} leaves no port above it for the rendezvous; set {ENV_RDZV_PORT}")
            })?),
            None => None,
        };
    }
    let (addr, port) = rdzv_override(get, addr, port)?;
    let addr = addr.ok_or_else(|| format!("{who} environment: MASTER_ADDR is not set"))?;
    let port = port.ok_or_else(|| format!("{who} environment: MASTER_PORT is not set"))?;
    Ok(RankEnv {
        rank,
        world,
        local_rank,
        local_world,
        launcher: Launcher::Torchrun,
        id: IdSource::Rendezvous { addr, port },
    })
}

/// Open MPI's variables.
fn open_mpi(get: &impl Fn(&str) -> Option<String>) -> Result<RankEnv, String> {
    let who = "Open MPI";
    let rank = need_num(get, "OMPI_COMM_WORLD_RANK", who)?;
    let world = need_num(get, "OMPI_COMM_WORLD_SIZE", who)?;
    let local_rank = need_num(get, "OMPI_COMM_WORLD_LOCAL_RANK", who)?;
    check_ranks(rank, world, local_rank, who)?;
    let local_world = opt_num(get, "OMPI_COMM_WORLD_LOCAL_SIZE", who)?;
    let port = match get("MASTER_PORT") {
        Some(v) => Some(parse_port("MASTER_PORT", &v, who)?),
        None => None,
    };
    let (addr, port) = rdzv_override(get, get("MASTER_ADDR"), port)?;
    let one_node = local_world == Some(world);
    let (addr, port) = match (addr, port) {
        (Some(a), Some(p)) => (a, p),
        (a, p) if one_node => (
            a.unwrap_or_else(|| DEFAULT_MASTER_ADDR.to_string()),
            p.unwrap_or(DEFAULT_MASTER_PORT),
        ),
        (a, _) => {
            let missing = if a.is_none() {
                "MASTER_ADDR"
            } else {
                "MASTER_PORT"
            };
            return Err(format!(
                "{who} environment: {missing} is not set and the {world} ranks are not all on one node \
                 (OMPI_COMM_WORLD_LOCAL_SIZE={}); export both, e.g. \
                 mpirun -x MASTER_ADDR=<rank-0 host> -x MASTER_PORT={DEFAULT_MASTER_PORT}",
                local_world.map_or("unset".to_string(), |l| l.to_string())
            ));
        }
    };
    Ok(RankEnv {
        rank,
        world,
        local_rank,
        local_world,
        launcher: Launcher::OpenMpi,
        id: IdSource::Rendezvous { addr, port },
    })
}

/// Slurm's variables (inside a job step).
fn slurm(get: &impl Fn(&str) -> Option<String>) -> Result<RankEnv, String> {
    let who = "Slurm";
    let rank = need_num(get, "SLURM_PROCID", who)?;
    let world = need_num(get, "SLURM_NTASKS", who)?;
    let local_rank = need_num(get, "SLURM_LOCALID", who)?;
    check_ranks(rank, world, local_rank, who)?;
    let port = match get("MASTER_PORT") {
        Some(v) => Some(parse_port("MASTER_PORT", &v, who)?),
        None => None,
    };
    let (addr, port) = rdzv_override(get, get("MASTER_ADDR"), port)?;
    let hint = "export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n1) \
                and MASTER_PORT=29500 before srun";
    let addr = addr.ok_or_else(|| format!("{who} environment: MASTER_ADDR is not set; {hint}"))?;
    let port = port.ok_or_else(|| format!("{who} environment: MASTER_PORT is not set; {hint}"))?;
    Ok(RankEnv {
        rank,
        world,
        local_rank,
        local_world: None,
        launcher: Launcher::Slurm,
        id: IdSource::Rendezvous { addr, port },
    })
}

/// The id as 256 lowercase hex characters (the library's [`UniqueId::to_hex`]).
pub fn to_hex(id: &[u8; UNIQUE_ID_BYTES]) -> String {
    UniqueId::from_bytes(*id).to_hex()
}

/// Parses an id from exactly 256 hex characters, either case
/// ([`UniqueId::from_hex`]).
pub fn id_from_hex(s: &str) -> Result<[u8; UNIQUE_ID_BYTES], String> {
    UniqueId::from_hex(s)
        .map(|id| id.to_bytes())
        .map_err(|e| e.to_string())
}

/// Wire magic of the rendezvous protocol (hello and reply).
const MAGIC: &[u8; 8] = b"MOEEPRV1";
/// Reply status: id follows.
const STATUS_OK: u8 = 0;
/// Reply status: rank 0 rejected the hello (world mismatch or duplicate rank).
const STATUS_REJECTED: u8 = 1;

/// Shares the 128-byte NCCL unique id over TCP, bounded by 60 s in total.
///
/// Rank 0 listens on `addr:port` (on that address when it is a loopback
/// address, else on all interfaces), calls `make_id`, and serves the id to
/// `world - 1` distinct ranks; every other rank connects to `addr:port` with
/// retries until it gets the id (so start order does not matter) and never
/// calls `make_id`. `world == 1` just calls `make_id`. Errors name `addr:port`.
///
/// Protocol: hello = magic(8) rank(u32 LE) world(u32 LE); reply = magic(8)
/// status(1) id(128). Connections with a wrong magic are ignored.
pub fn rendezvous(
    rank: usize,
    world: usize,
    addr: &str,
    port: u16,
    make_id: impl FnOnce() -> Result<[u8; UNIQUE_ID_BYTES], String>,
) -> Result<[u8; UNIQUE_ID_BYTES], String> {
    rendezvous_with_timeout(rank, world, addr, port, RENDEZVOUS_TIMEOUT, make_id)
}

/// [`rendezvous`] with an explicit total timeout.
pub fn rendezvous_with_timeout(
    rank: usize,
    world: usize,
    addr: &str,
    port: u16,
    timeout: Duration,
    make_id: impl FnOnce() -> Result<[u8; UNIQUE_ID_BYTES], String>,
) -> Result<[u8; UNIQUE_ID_BYTES], String> {
    if world == 0 || rank >= world {
        return Err(format!(
            "rendezvous: rank {rank} is not below the world size {world}"
        ));
    }
    if u32::try_from(world).is_err() {
        return Err(format!("rendezvous: world size {world} is too large"));
    }
    if world == 1 {
        return make_id();
    }
    let deadline = Instant::now() + timeout;
    if rank == 0 {
        serve_id(world, addr, port, deadline, timeout, make_id)
    } else {
        fetch_id(rank, world, addr, port, deadline, timeout)
    }
}

/// Address rank 0 binds. A loopback literal (`127.0.0.1`, `::1`,
/// `localhost`) is bound as such; anything else binds all interfaces of the
/// address family, because a host name may resolve to a loopback alias
/// (`127.0.1.1`) on its own node while the other nodes reach it through
/// another address.
fn bind_addr(addr: &str, port: u16) -> Result<SocketAddr, String> {
    let literal: Option<IpAddr> = addr
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse()
        .ok();
    if addr == "localhost" || literal.is_some_and(|ip| ip.is_loopback()) {
        return (addr, port)
            .to_socket_addrs()
            .map_err(|e| format!("rendezvous: cannot resolve {addr}:{port}: {e}"))?
            .next()
            .ok_or_else(|| format!("rendezvous: {addr}:{port} resolves to no address"));
    }
    let v6 = match literal {
        Some(ip) => ip.is_ipv6(),
        // A host name: follow its first resolution, IPv4 if it has none here.
        None => (addr, port)
            .to_socket_addrs()
            .ok()
            .and_then(|mut it| it.next())
            .is_some_and(|sa| sa.is_ipv6()),
    };
    let any = if v6 {
        IpAddr::V6(Ipv6Addr::UNSPECIFIED)
    } else {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    };
    Ok(SocketAddr::new(any, port))
}

/// Rank 0 of [`rendezvous`]: makes the id and serves it to every other rank.
fn serve_id(
    world: usize,
    addr: &str,
    port: u16,
    deadline: Instant,
    timeout: Duration,
    make_id: impl FnOnce() -> Result<[u8; UNIQUE_ID_BYTES], String>,
) -> Result<[u8; UNIQUE_ID_BYTES], String> {
    let bind = bind_addr(addr, port)?;
    let listener = TcpListener::bind(bind).map_err(|e| {
        format!(
            "rendezvous: rank 0 cannot listen on {addr}:{port} ({bind}): {e}; \
             is the port in use? set {ENV_RDZV_PORT} to another one"
        )
    })?;
    let id = make_id()?;
    listener
        .set_nonblocking(true)
        .map_err(|e| format!("rendezvous: {addr}:{port}: {e}"))?;
    let mut served = vec![false; world];
    served[0] = true;
    let mut left = world - 1;
    while left > 0 {
        let now = Instant::now();
        if now >= deadline {
            let missing: Vec<String> = served
                .iter()
                .enumerate()
                .filter(|(_, &s)| !s)
                .map(|(r, _)| r.to_string())
                .collect();
            return Err(format!(
                "rendezvous: rank 0 waited {} s on {addr}:{port} but only {} of {} ranks connected (missing: {})",
                timeout.as_secs_f64(),
                world - 1 - left,
                world - 1,
                missing.join(", ")
            ));
        }
        match listener.accept() {
            Ok((stream, peer)) => {
                let wait = (deadline - now).min(Duration::from_secs(5));
                match answer_hello(stream, world, &mut served, &id, wait) {
                    Ok(true) => left -= 1,
                    Ok(false) => {} // not one of ours: ignore
                    Err(e) => {
                        return Err(format!("rendezvous on {addr}:{port}: {e} (from {peer})"))
                    }
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(format!("rendezvous: accept on {addr}:{port}: {e}")),
        }
    }
    Ok(id)
}

/// Reads one hello and answers it. `Ok(true)`: a new rank got the id;
/// `Ok(false)`: not a valid hello (ignored); `Err`: a rank of another world
/// or a duplicate rank (answered with a rejection).
fn answer_hello(
    mut stream: TcpStream,
    world: usize,
    served: &mut [bool],
    id: &[u8; UNIQUE_ID_BYTES],
    wait: Duration,
) -> Result<bool, String> {
    let setup = stream
        .set_nonblocking(false)
        .and_then(|_| stream.set_read_timeout(Some(wait.max(Duration::from_millis(1)))))
        .and_then(|_| stream.set_write_timeout(Some(wait.max(Duration::from_millis(1)))));
    if setup.is_err() {
        return Ok(false);
    }
    let mut hello = [0u8; 16];
    if stream.read_exact(&mut hello).is_err() || &hello[..8] != MAGIC {
        return Ok(false);
    }
    let r = u32::from_le_bytes([hello[8], hello[9], hello[10], hello[11]]) as usize;
    let w = u32::from_le_bytes([hello[12], hello[13], hello[14], hello[15]]) as usize;
    let problem = if w != world {
        Some(format!(
            "rank {r} says the world size is {w}, rank 0 has {world}"
        ))
    } else if r == 0 || r >= world {
        Some(format!("a peer claims rank {r} in a world of {world}"))
    } else if served[r] {
        Some(format!(
            "rank {r} connected twice (two processes with the same rank?)"
        ))
    } else {
        None
    };
    let mut reply = Vec::with_capacity(MAGIC.len() + 1 + UNIQUE_ID_BYTES);
    reply.extend_from_slice(MAGIC);
    match problem {
        Some(p) => {
            reply.push(STATUS_REJECTED);
            reply.extend_from_slice(&[0u8; UNIQUE_ID_BYTES]);
            let _ = stream.write_all(&reply);
            Err(p)
        }
        None => {
            reply.push(STATUS_OK);
            reply.extend_from_slice(id);
            if stream
                .write_all(&reply)
                .and_then(|_| stream.flush())
                .is_err()
            {
                // The peer went away; it will retry.
                return Ok(false);
            }
            served[r] = true;
            Ok(true)
        }
    }
}

/// The other ranks of [`rendezvous`]: fetch the id from rank 0, retrying until the deadline.
fn fetch_id(
    rank: usize,
    world: usize,
    addr: &str,
    port: u16,
    deadline: Instant,
    timeout: Duration,
) -> Result<[u8; UNIQUE_ID_BYTES], String> {
    let mut last_err = String::from("no attempt made");
    let mut backoff = Duration::from_millis(20);
    loop {
        let now = Instant::now();
        if now >= deadline {
            return Err(format!(
                "rendezvous: rank {rank} got no NCCL id from rank 0 at {addr}:{port} within {} s \
                 (last error: {last_err}); is rank 0 running and {addr}:{port} reachable?",
                timeout.as_secs_f64()
            ));
        }
        match try_fetch(rank, world, addr, port, deadline - now) {
            Ok(id) => return Ok(id),
            Err(Attempt::Fatal(e)) => return Err(format!("rendezvous on {addr}:{port}: {e}")),
            Err(Attempt::Retry(e)) => last_err = e,
        }
        let left = deadline.saturating_duration_since(Instant::now());
        thread::sleep(backoff.min(left));
        backoff = (backoff * 2).min(Duration::from_millis(500));
    }
}

/// Why one fetch attempt failed.
enum Attempt {
    /// Worth another try (rank 0 not listening yet, a dropped connection).
    Retry(String),
    /// Rank 0 rejected this rank: give up.
    Fatal(String),
}

/// One connection to rank 0: hello, then the id.
fn try_fetch(
    rank: usize,
    world: usize,
    addr: &str,
    port: u16,
    left: Duration,
) -> Result<[u8; UNIQUE_ID_BYTES], Attempt> {
    let addrs: Vec<SocketAddr> = (addr, port)
        .to_socket_addrs()
        .map_err(|e| Attempt::Retry(format!("cannot resolve {addr}: {e}")))?
        .collect();
    let mut last = Attempt::Retry(format!("{addr} resolves to no address"));
    for sa in addrs {
        let per_try = left
            .min(Duration::from_secs(2))
            .max(Duration::from_millis(1));
        let mut stream = match TcpStream::connect_timeout(&sa, per_try) {
            Ok(s) => s,
            Err(e) => {
                last = Attempt::Retry(format!("connect {sa}: {e}"));
                continue;
            }
        };
        let io = left.max(Duration::from_millis(1));
        let _ = stream.set_read_timeout(Some(io));
        let _ = stream.set_write_timeout(Some(io));
        let mut hello = [0u8; 16];
        hello[..8].copy_from_slice(MAGIC);
        hello[8..12].copy_from_slice(&(rank as u32).to_le_bytes());
        hello[12..16].copy_from_slice(&(world as u32).to_le_bytes());
        if let Err(e) = stream.write_all(&hello) {
            last = Attempt::Retry(format!("send to {sa}: {e}"));
            continue;
        }
        let mut reply = [0u8; 8 + 1 + UNIQUE_ID_BYTES];
        if let Err(e) = stream.read_exact(&mut reply) {
            last = Attempt::Retry(format!("read from {sa}: {e}"));
            continue;
        }
        if &reply[..8] != MAGIC {
            last = Attempt::Retry(format!("{sa} is not an ep-bench rendezvous"));
            continue;
        }
        if reply[8] != STATUS_OK {
            return Err(Attempt::Fatal(format!(
                "rank 0 rejected rank {rank} of world {world} (world size mismatch or duplicate rank)"
            )));
        }
        let mut id = [0u8; UNIQUE_ID_BYTES];
        id.copy_from_slice(&reply[9..]);
        return Ok(id);
    }
    Err(last)
}

/// Spawns `n` ranks of this executable (`std::env::current_exe()`) with the
/// same `args` (program name excluded) and `MOE_EP_BENCH_RANK/WORLD/
/// LOCAL_RANK/UNIQUE_ID` set; stdout/stderr pass through; the caller's
/// `CUDA_VISIBLE_DEVICES` is inherited unchanged (rank `r` uses device `r`).
/// Waits for all of them. If one fails, the others are killed (no hang) and
/// its exit code is returned: the first non-zero code observed (128 + signal
/// for a rank killed by a signal), or 0 when all succeed. `Err` when a rank
/// cannot be started.
pub fn spawn_ranks(
    n: usize,
    unique_id: [u8; UNIQUE_ID_BYTES],
    args: &[OsString],
) -> Result<i32, String> {
    let exe = std::env::current_exe()
        .map_err(|e| format!("cannot find the ep-bench executable to spawn ranks: {e}"))?;
    spawn_program(&exe, n, unique_id, args)
}

/// [`spawn_ranks`] for an arbitrary program (tests).
pub fn spawn_program<A: AsRef<OsStr>>(
    program: &Path,
    n: usize,
    unique_id: [u8; UNIQUE_ID_BYTES],
    args: &[A],
) -> Result<i32, String> {
    if n == 0 {
        return Err("cannot spawn 0 ranks".to_string());
    }
    let hex = to_hex(&unique_id);
    let mut children: Vec<Option<Child>> = Vec::with_capacity(n);
    for rank in 0..n {
        let spawned = Command::new(program)
            .args(args)
            .env(ENV_RANK, rank.to_string())
            .env(ENV_WORLD, n.to_string())
            .env(ENV_LOCAL_RANK, rank.to_string())
            .env(ENV_UNIQUE_ID, &hex)
            .spawn();
        match spawned {
            Ok(c) => children.push(Some(c)),
            Err(e) => {
                kill_all(&mut children);
                return Err(format!(
                    "cannot start rank {rank} ({}): {e}",
                    program.display()
                ));
            }
        }
    }
    let mut first_failure: Option<i32> = None;
    loop {
        let mut running = 0;
        for slot in children.iter_mut() {
            let Some(child) = slot else { continue };
            match child.try_wait() {
                Ok(Some(status)) => {
                    *slot = None;
                    let code = exit_code(&status);
                    if code != 0 && first_failure.is_none() {
                        first_failure = Some(code);
                    }
                }
                Ok(None) => running += 1,
                Err(_) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    *slot = None;
                    first_failure.get_or_insert(1);
                }
            }
        }
        if first_failure.is_some() {
            kill_all(&mut children);
            break;
        }
        if running == 0 {
            break;
        }
        thread::sleep(Duration::from_millis(20));
    }
    Ok(first_failure.unwrap_or(0))
}

/// Kills and reaps every child still running (our own children only).
fn kill_all(children: &mut [Option<Child>]) {
    for slot in children.iter_mut() {
        if let Some(mut c) = slot.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A child's exit code, 128 + the signal that killed it, or 1.
fn exit_code(status: &std::process::ExitStatus) -> i32 {
    if let Some(c) = status.code() {
        return c;
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = status.signal() {
            return 128 + sig;
        }
    }
    1
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::sync::mpsc;

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn rank_of(pairs: &[(&str, &str)]) -> RankEnv {
        match Role::from_map(&env(pairs)) {
            Ok(Role::Rank(r)) => r,
            other => panic!("expected a rank for {pairs:?}, got {other:?}"),
        }
    }

    fn role_err(pairs: &[(&str, &str)]) -> String {
        match Role::from_map(&env(pairs)) {
            Err(e) => e,
            other => panic!("expected an error for {pairs:?}, got {other:?}"),
        }
    }

    fn free_port() -> u16 {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    }

    #[test]
    fn hex_round_trip() {
        let mut id = [0u8; UNIQUE_ID_BYTES];
        for (i, b) in id.iter_mut().enumerate() {
            *b = (i * 37 + 11) as u8;
        }
        let hex = to_hex(&id);
        assert_eq!(hex.len(), 256);
        assert!(hex.starts_with("0b30"));
        assert_eq!(id_from_hex(&hex).unwrap(), id);
        assert_eq!(id_from_hex(&hex.to_uppercase()).unwrap(), id);
        assert!(id_from_hex("abc").unwrap_err().contains("256"));
        let bad = format!("zz{}", &hex[2..]);
        assert!(id_from_hex(&bad).unwrap_err().contains("position 0"));
        // Multi-byte characters must not panic.
        let uni = "é".repeat(128);
        assert!(id_from_hex(&uni).is_err());
    }

    #[test]
    fn no_launcher_is_parent() {
        assert_eq!(Role::from_map(&env(&[])).unwrap(), Role::Parent);
        assert_eq!(
            Role::from_map(&env(&[("HOME", "/root"), ("MASTER_ADDR", "x")])).unwrap(),
            Role::Parent
        );
        // An sbatch script (no step) and a one-task step are not launchers.
        let batch = [
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "0"),
        ];
        assert_eq!(Role::from_map(&env(&batch)).unwrap(), Role::Parent);
        let one = [
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_STEP_ID", "0"),
        ];
        assert_eq!(Role::from_map(&env(&one)).unwrap(), Role::Parent);
    }

    #[test]
    fn own_child_env() {
        let id = [0xabu8; UNIQUE_ID_BYTES];
        let hex = to_hex(&id);
        let r = rank_of(&[
            (ENV_RANK, "2"),
            (ENV_WORLD, "4"),
            (ENV_LOCAL_RANK, "2"),
            (ENV_UNIQUE_ID, &hex),
            // Our own variables win over any launcher's.
            ("RANK", "7"),
            ("WORLD_SIZE", "8"),
        ]);
        assert_eq!((r.rank, r.world, r.local_rank, r.device()), (2, 4, 2, 2));
        assert_eq!(r.launcher, Launcher::EpBench);
        assert_eq!(r.id, IdSource::Given(id));
        let got = r
            .unique_id(|| Err("must not be called".to_string()))
            .unwrap();
        assert_eq!(got, id);
        let e = role_err(&[(ENV_RANK, "0"), (ENV_WORLD, "2"), (ENV_LOCAL_RANK, "0")]);
        assert!(e.contains(ENV_UNIQUE_ID), "{e}");
        let e = role_err(&[
            (ENV_RANK, "5"),
            (ENV_WORLD, "2"),
            (ENV_LOCAL_RANK, "0"),
            (ENV_UNIQUE_ID, &hex),
        ]);
        assert!(e.contains("rank 5"), "{e}");
        let e = role_err(&[
            (ENV_RANK, "0"),
            (ENV_WORLD, "2"),
            (ENV_LOCAL_RANK, "0"),
            (ENV_UNIQUE_ID, "00"),
        ]);
        assert!(e.contains(ENV_UNIQUE_ID), "{e}");
    }

    #[test]
    fn torchrun_env() {
        let base = [
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "3"),
            ("LOCAL_WORLD_SIZE", "8"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29400"),
        ];
        let r = rank_of(&base);
        assert_eq!((r.rank, r.world, r.local_rank), (3, 8, 3));
        assert_eq!(r.local_world, Some(8));
        assert_eq!(r.launcher, Launcher::Torchrun);
        assert_eq!(
            r.id,
            IdSource::Rendezvous {
                addr: "node0".into(),
                port: 29400
            }
        );
        // Agent store on MASTER_PORT: use the next port.
        let mut agent = base.to_vec();
        agent.push(("TORCHELASTIC_USE_AGENT_STORE", "True"));
        let r = rank_of(&agent);
        assert_eq!(
            r.id,
            IdSource::Rendezvous {
                addr: "node0".into(),
                port: 29401
            }
        );
        // Explicit override wins.
        agent.push((ENV_RDZV_PORT, "31000"));
        agent.push((ENV_RDZV_ADDR, "10.0.0.1"));
        let r = rank_of(&agent);
        assert_eq!(
            r.id,
            IdSource::Rendezvous {
                addr: "10.0.0.1".into(),
                port: 31000
            }
        );
        let e = role_err(&base[..5]);
        assert!(e.contains("MASTER_PORT"), "{e}");
        let e = role_err(&[("RANK", "0"), ("WORLD_SIZE", "2")]);
        assert!(e.contains("LOCAL_RANK"), "{e}");
        let e = role_err(&[
            ("RANK", "x"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "a"),
            ("MASTER_PORT", "1"),
        ]);
        assert!(e.contains("RANK='x'"), "{e}");
        let e = role_err(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "a"),
            ("MASTER_PORT", "99999"),
        ]);
        assert!(e.contains("MASTER_PORT"), "{e}");
    }

    #[test]
    fn open_mpi_env() {
        let one_node = [
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
        ];
        let r = rank_of(&one_node);
        assert_eq!((r.rank, r.world, r.local_rank), (1, 4, 1));
        assert_eq!(r.launcher, Launcher::OpenMpi);
        assert_eq!(
            r.id,
            IdSource::Rendezvous {
                addr: DEFAULT_MASTER_ADDR.into(),
                port: DEFAULT_MASTER_PORT
            }
        );
        let mut with_addr = one_node.to_vec();
        with_addr.push(("MASTER_ADDR", "host0"));
        with_addr.push(("MASTER_PORT", "12345"));
        assert_eq!(
            rank_of(&with_addr).id,
            IdSource::Rendezvous {
                addr: "host0".into(),
                port: 12345
            }
        );
        // Two nodes: no default.
        let two_nodes = [
            ("OMPI_COMM_WORLD_RANK", "5"),
            ("OMPI_COMM_WORLD_SIZE", "8"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
        ];
        let e = role_err(&two_nodes);
        assert!(e.contains("MASTER_ADDR") && e.contains("one node"), "{e}");
        let mut two = two_nodes.to_vec();
        two.push(("MASTER_ADDR", "host0"));
        assert!(role_err(&two).contains("MASTER_PORT"));
        two.push(("MASTER_PORT", "2000"));
        assert_eq!(rank_of(&two).local_rank, 1);
    }

    #[test]
    fn slurm_env() {
        let step = [
            ("SLURM_PROCID", "6"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_LOCALID", "2"),
            ("SLURM_STEP_ID", "0"),
        ];
        let e = role_err(&step);
        assert!(e.contains("MASTER_ADDR"), "{e}");
        let mut full = step.to_vec();
        full.push(("MASTER_ADDR", "gpu001"));
        assert!(role_err(&full).contains("MASTER_PORT"));
        full.push(("MASTER_PORT", "29500"));
        let r = rank_of(&full);
        assert_eq!((r.rank, r.world, r.local_rank), (6, 16, 2));
        assert_eq!(r.launcher, Launcher::Slurm);
        assert_eq!(
            r.id,
            IdSource::Rendezvous {
                addr: "gpu001".into(),
                port: 29500
            }
        );
        // torchrun under srun: torchrun wins.
        full.extend([("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1")]);
        assert_eq!(rank_of(&full).launcher, Launcher::Torchrun);
    }

    #[test]
    fn rendezvous_three_ranks_on_loopback() {
        let port = free_port();
        let mut id = [0u8; UNIQUE_ID_BYTES];
        for (i, b) in id.iter_mut().enumerate() {
            *b = (255 - i) as u8;
        }
        let (tx, rx) = mpsc::channel();
        let mut handles = Vec::new();
        // Clients first: they must retry until rank 0 listens.
        for rank in [2usize, 1] {
            let tx = tx.clone();
            handles.push(thread::spawn(move || {
                let got = rendezvous(rank, 3, "127.0.0.1", port, || {
                    Err("only rank 0 makes the id".to_string())
                });
                tx.send((rank, got)).unwrap();
            }));
        }
        thread::sleep(Duration::from_millis(150));
        {
            let tx = tx.clone();
            handles.push(thread::spawn(move || {
                let got = rendezvous(0, 3, "127.0.0.1", port, || Ok(id));
                tx.send((0, got)).unwrap();
            }));
        }
        drop(tx);
        for h in handles {
            h.join().unwrap();
        }
        let mut results: Vec<(usize, Result<[u8; UNIQUE_ID_BYTES], String>)> = rx.iter().collect();
        results.sort_by_key(|(r, _)| *r);
        assert_eq!(results.len(), 3);
        for (rank, got) in results {
            assert_eq!(got.as_ref().map_err(|e| e.clone()), Ok(&id), "rank {rank}");
        }
    }

    #[test]
    fn rank0_bind_address() {
        assert_eq!(
            bind_addr("127.0.0.1", 5000).unwrap(),
            "127.0.0.1:5000".parse().unwrap()
        );
        assert!(bind_addr("localhost", 5000).unwrap().ip().is_loopback());
        assert_eq!(
            bind_addr("10.1.2.3", 5000).unwrap(),
            "0.0.0.0:5000".parse().unwrap()
        );
        assert_eq!(
            bind_addr("fe80::1", 5000).unwrap(),
            "[::]:5000".parse().unwrap()
        );
    }

    #[test]
    fn rendezvous_world_of_one_and_bad_rank() {
        let id = [9u8; UNIQUE_ID_BYTES];
        assert_eq!(rendezvous(0, 1, "127.0.0.1", 1, || Ok(id)).unwrap(), id);
        assert!(rendezvous(3, 2, "127.0.0.1", 1, || Ok(id)).is_err());
    }

    #[test]
    fn rendezvous_timeout_names_address() {
        let port = free_port();
        let e =
            rendezvous_with_timeout(1, 2, "127.0.0.1", port, Duration::from_millis(300), || {
                Err("unused".to_string())
            })
            .unwrap_err();
        assert!(e.contains(&format!("127.0.0.1:{port}")), "{e}");
        let e =
            rendezvous_with_timeout(0, 3, "127.0.0.1", port, Duration::from_millis(200), || {
                Ok([0u8; UNIQUE_ID_BYTES])
            })
            .unwrap_err();
        assert!(
            e.contains(&format!("127.0.0.1:{port}")) && e.contains("missing: 1, 2"),
            "{e}"
        );
    }

    #[test]
    fn rendezvous_rejects_world_mismatch() {
        let port = free_port();
        let server = thread::spawn(move || {
            rendezvous_with_timeout(0, 2, "127.0.0.1", port, Duration::from_secs(10), || {
                Ok([1u8; UNIQUE_ID_BYTES])
            })
        });
        let client =
            rendezvous_with_timeout(1, 3, "127.0.0.1", port, Duration::from_secs(10), || {
                Err("unused".to_string())
            });
        assert!(client.unwrap_err().contains("rejected"));
        assert!(server.join().unwrap().unwrap_err().contains("world size"));
    }

    #[cfg(unix)]
    #[test]
    fn spawn_passes_env_and_kills_on_failure() {
        let sh = Path::new("/bin/sh");
        let id = [0x5au8; UNIQUE_ID_BYTES];
        // All succeed when the env is right.
        let script = format!(
            "[ \"$MOE_EP_BENCH_WORLD\" = 3 ] && [ \"$MOE_EP_BENCH_RANK\" = \"$MOE_EP_BENCH_LOCAL_RANK\" ] \
             && [ \"$MOE_EP_BENCH_UNIQUE_ID\" = {} ]",
            to_hex(&id)
        );
        let args = vec!["-c".to_string(), script];
        assert_eq!(spawn_program(sh, 3, id, &args).unwrap(), 0);
        // Rank 1 fails with 7, the others would sleep for a minute: no hang.
        let args = vec![
            "-c".to_string(),
            "if [ \"$MOE_EP_BENCH_RANK\" = 1 ]; then exit 7; fi; exec sleep 60".to_string(),
        ];
        let t = Instant::now();
        assert_eq!(spawn_program(sh, 3, id, &args).unwrap(), 7);
        assert!(t.elapsed() < Duration::from_secs(20));
        let none: &[&str] = &[];
        assert!(spawn_program(Path::new("/nonexistent/ep-bench"), 2, id, none).is_err());
        assert!(spawn_program(sh, 0, id, none).is_err());
    }
}
