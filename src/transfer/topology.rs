//! Where a device sits in the machine: the CPUs of its NUMA node, to which staging threads are
//! bound so that their pinned buffers are allocated (first touch) and copied on the node of the
//! device's host link, and the peers that can relay copies to it.

use crate::device::SharedDevice;

/// The CPUs of NUMA node `node`, from `/sys/devices/system/node/nodeN/cpulist`.
pub fn node_cpus(node: u32) -> Option<Vec<usize>> {
    let text =
        std::fs::read_to_string(format!("/sys/devices/system/node/node{node}/cpulist")).ok()?;
    let cpus = parse_cpu_list(&text)?;
    (!cpus.is_empty()).then_some(cpus)
}

/// Bytes of the CPU's last-level cache (of CPU 0, from sysfs), when the system says.
pub fn last_level_cache() -> Option<usize> {
    let mut best: Option<(u32, usize)> = None;
    for index in 0..16 {
        let dir = format!("/sys/devices/system/cpu/cpu0/cache/index{index}");
        let Ok(level) = std::fs::read_to_string(format!("{dir}/level")) else {
            continue;
        };
        let Ok(size) = std::fs::read_to_string(format!("{dir}/size")) else {
            continue;
        };
        if let (Ok(level), Some(size)) = (level.trim().parse::<u32>(), parse_cache_size(&size)) {
            if best.is_none_or(|(l, _)| level > l) {
                best = Some((level, size));
            }
        }
    }
    best.map(|(_, size)| size)
}

/// Parses a sysfs cache size such as `48K`, `2048K` or `300M`.
pub fn parse_cache_size(text: &str) -> Option<usize> {
    let text = text.trim();
    let (digits, unit) = match text.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => text.split_at(i),
        None => (text, ""),
    };
    let n: usize = digits.parse().ok()?;
    let shift = match unit {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        _ => return None,
    };
    n.checked_mul(1 << shift)
}

/// Parses a kernel CPU list such as `0-3,8,10-11`.
pub fn parse_cpu_list(text: &str) -> Option<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
                if b < a || b - a > 1 << 16 {
                    return None;
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(part.trim().parse().ok()?),
        }
    }
    Some(cpus)
}

/// Binds the calling thread to `cpus`; false when the system refuses (the thread runs anywhere).
pub fn bind_current_thread(cpus: &[usize]) -> bool {
    // SAFETY: a zeroed cpu_set_t is the empty set; CPU_SET only writes inside it (indexes past
    // its size are skipped), and sched_setaffinity reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        let capacity = 8 * std::mem::size_of::<libc::cpu_set_t>();
        for &cpu in cpus.iter().filter(|&&c| c < capacity) {
            libc::CPU_SET(cpu, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

/// The CPUs staging threads for `device` should run on: its NUMA node's, when known.
pub fn cpus_near(device: &SharedDevice) -> Option<Vec<usize>> {
    node_cpus(device.numa_node()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists() {
        assert_eq!(
            parse_cpu_list("0-3,8,10-11\n"),
            Some(vec![0, 1, 2, 3, 8, 10, 11])
        );
        assert_eq!(parse_cpu_list("5"), Some(vec![5]));
        assert_eq!(parse_cpu_list(""), Some(vec![]));
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("x"), None);
    }

    #[test]
    fn cache_sizes() {
        assert_eq!(parse_cache_size("300M\n"), Some(300 << 20));
        assert_eq!(parse_cache_size("2048K"), Some(2 << 20));
        assert_eq!(parse_cache_size("512"), Some(512));
        assert_eq!(parse_cache_size("1T"), None);
        assert_eq!(parse_cache_size("K"), None);
        // The machine's own, when it says: a plausible size.
        if let Some(bytes) = last_level_cache() {
            assert!((64 << 10..=64 << 30).contains(&bytes), "{bytes}");
        }
    }

    #[test]
    fn binding_to_the_current_cpus_works() {
        // Bind to every CPU the process may use: always allowed, changes nothing.
        let all: Vec<usize> = (0..1024).collect();
        let handle = std::thread::spawn(move || bind_current_thread(&all));
        assert!(handle.join().unwrap_or(false));
    }
}
