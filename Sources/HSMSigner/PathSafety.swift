import Glibc
internal import CSignerShim

/// Checks that no user other than root and this process's can change what
/// a path leads to, as OpenSSH's `StrictModes` does for `authorized_keys`:
/// a directory on the way that another user owns, or may write without the
/// sticky bit, lets that user rename or replace what lies below it.
public enum PathSafety {
    /// The first directory from `/` down to the parent of `path` that
    /// another user could change, described, or nil when there is none.
    /// A directory is safe when it belongs to root or to this process's
    /// uid and has the sticky bit (which keeps others from renaming or
    /// removing what they do not own, as in /tmp), or when others may not
    /// write it and its group may only if that group is this process's and
    /// has no other member (none listed, no other user with it as primary group), with no access control list (whose mask the
    /// group bits then are). Each
    /// directory is looked up with `stat(2)`, symbolic links followed; check
    /// a resolved path (`realpath(3)`) as well to cover the directories a
    /// link leads through.
    /// - Parameter path: an absolute path.
    /// - Returns: "the directory D (owner uid U, group gid G, mode M) …",
    ///   saying who may change it, or that it is missing (a directory made
    ///   after the check is not checked); nil when every directory is safe
    ///   or `path` is not absolute.
    public static func unsafeDirectory(above path: String) -> String? {
        guard path.hasPrefix("/") else { return nil }
        let components = path.split(separator: "/", omittingEmptySubsequences: true).dropLast()
        var directory = ""
        for component in [""] + components.map(String.init) {
            directory = component.isEmpty ? "/" : (directory == "/" ? "/" : directory + "/") + component
            if let problem = problem(directory: directory) { return problem }
        }
        return nil
    }

    /// Why another user could change entries of `directory`, or nil.
    static func problem(directory: String) -> String? {
        var info = stat()
        // A directory missing now could be made by anyone allowed to write
        // its parent (in a sticky one, /var/tmp, by any user) after the check.
        guard stat(directory, &info) == 0 else {
            return "the directory \(directory) cannot be checked (\(String(cString: strerror(errno))))"
        }
        let mode = info.st_mode & 0o7777
        let described = "the directory \(directory) (owner uid \(info.st_uid), group gid \(info.st_gid), mode \(String(mode, radix: 8)))"
        if info.st_uid != 0 && info.st_uid != geteuid() {
            return "\(described) belongs to another user, who could rename or replace what lies below it"
        }
        guard mode & mode_t(S_ISVTX) == 0 else { return nil }  // others cannot rename what they do not own
        if mode & mode_t(S_IWOTH) != 0 {
            return "\(described) may be written by other users without the sticky bit, so they could rename or replace what lies below it"
        }
        if mode & mode_t(S_IWGRP) != 0 {
            // With a POSIX ACL the group bits are its mask: a named user or
            // group may write, whatever the owning group is.
            if CSignerShim_has_access_acl(directory) != 0 {
                return "\(described) has an access control list that lets users or groups besides its owner write it (the group bits are its mask), so they could rename or replace what lies below it"
            }
            if info.st_gid != getegid() || !groupHasNoOtherMembers(info.st_gid) {
                return "\(described) may be written by its group, which has other members than this user, so they could rename or replace what lies below it"
            }
        }
        return nil
    }

    /// The first directory another user could change above `path` as
    /// written (made absolute against the working directory), then above
    /// where it leads after symbolic links (`realpath(3)`), described as
    /// ``unsafeDirectory(above:)`` describes it; nil when both are safe. A
    /// path that cannot be resolved is left to the caller's own open, which
    /// then fails.
    /// - Parameter path: a file path, absolute or relative.
    /// - Returns: a sentence naming the directory, its owner and mode.
    public static func unsafeDirectory(aboveWrittenOrResolved path: String) -> String? {
        var written = path
        if !path.hasPrefix("/"), let cwd = getcwd(nil, 0) {
            written = String(cString: cwd) + "/" + path
            free(cwd)
        }
        if let problem = unsafeDirectory(above: written) { return problem }
        guard let resolved = realpath(path, nil) else { return nil }
        defer { free(resolved) }
        return unsafeDirectory(above: String(cString: resolved))
    }

    /// Whether group `gid` has no member but this process's user: no user
    /// listed in it in the group database (`getgrgid(3)`) and no other user
    /// whose primary group it is in the user database (`getpwent_r(3)`)
    /// (a user private group, or root's group with no one added to it).
    static func groupHasNoOtherMembers(_ gid: gid_t) -> Bool {
        let own = getpwuid(geteuid()).map { String(cString: $0.pointee.pw_name) }
        if let group = getgrgid(gid), var member = group.pointee.gr_mem {
            while let name = member.pointee {
                if String(cString: name) != own { return false }
                member += 1
            }
        }
        return !primaryGroupUsers(gid).contains { $0 != geteuid() }
    }

    /// The uids of every user whose primary group is `gid`, from the user
    /// database (`setpwent(3)`, `getpwent_r(3)`; `/etc/passwd` and whatever
    /// else NSS lists). Called at start, not per request.
    static func primaryGroupUsers(_ gid: gid_t) -> [uid_t] {
        var uids: [uid_t] = []
        var entry = passwd()
        var buffer = [CChar](repeating: 0, count: 4096)
        var result: UnsafeMutablePointer<passwd>?
        setpwent()
        defer { endpwent() }
        while true {
            let status = getpwent_r(&entry, &buffer, buffer.count, &result)
            if status == ERANGE && buffer.count < 1 << 20 {
                buffer = [CChar](repeating: 0, count: buffer.count * 2)
                continue
            }
            guard status == 0, let found = result else { break }
            if found.pointee.pw_gid == gid { uids.append(found.pointee.pw_uid) }
        }
        return uids
    }
}
