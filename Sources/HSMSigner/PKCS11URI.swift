// The token's location as one RFC 7512 PKCS#11 URI, parsed by p11-kit.
internal import CPKCS11

#if canImport(Glibc)
import Glibc
#endif

/// Where the key lives: an RFC 7512 PKCS#11 URI such as
/// `pkcs11:token=signer?module-path=/usr/lib/softhsm/libsofthsm2.so&pin-source=file:/etc/signerd/pin`.
///
/// p11-kit parses it (`p11_kit_uri_parse`). signerd uses:
/// - the token attributes (`token`, `serial`, `manufacturer`, `model`) to pick
///   the token, matched by `p11_kit_uri_match_token_info`; at least `token`
///   or `serial` is required, and `slot-id` is refused because slot IDs
///   change (SoftHSM renumbers them);
/// - `module-path`, or `module-name` resolved through p11-kit's registered
///   modules;
/// - `pin-source=file:/path` (preferred) or `pin-value` (works, logs a warning),
///   never both.
///
/// Anything p11-kit would ignore or resolve silently is refused: an attribute
/// it does not recognize (p11-kit keeps an unknown query attribute as a
/// vendor attribute that nothing reads), an attribute given twice (p11-kit
/// keeps the last), and `pin-value` together with `pin-source`.
public final class PKCS11URI: @unchecked Sendable, CustomStringConvertible {
    // The P11KitUri is only read after init (matching copies the token info);
    // p11-kit's getters do not mutate it.
    private let uri: OpaquePointer
    /// The URI as given (whitespace removed, as p11-kit reads it), with the
    /// value of every `pin-value`, in the path or the query, replaced by
    /// `***`: safe to log.
    public let redacted: String
    /// The `token` attribute (the token label), if given.
    public let tokenLabel: String?
    /// The `serial` attribute, if given.
    public let tokenSerial: String?
    /// `module-path`, if given.
    public let modulePath: String?
    /// `module-name`, if given.
    public let moduleName: String?
    /// The module as the URI names it (RFC 7512's `module-path` and
    /// `module-name` query attributes): `module-path` when given, else
    /// `module-name`, else nil. For the checks made on a module before it
    /// is loaded (is it SoftHSM, where are its tokens).
    public var module: String? { modulePath ?? moduleName }
    /// `pin-source`, if given.
    public let pinSource: String?
    /// Whether the URI carries the PIN itself (`pin-value`).
    public let hasPINValue: Bool
    /// What to do about a URI that carries the PIN (``hasPINValue``): the
    /// hint of the `pin_value_in_uri` warning, at start and from `--check-config`.
    public static let pinValueHint = "use pin-source=file:/path with mode 0600 instead of pin-value"

    /// Parses `text`.
    /// - Parameter text: a `pkcs11:` URI.
    /// - Throws: ``HSMError/Code/invalidURI`` naming what is wrong (p11-kit's
    ///   parse message, an attribute p11-kit does not recognize or one given
    ///   twice, both `pin-value` and `pin-source`, a `slot-id`, no token
    ///   selector, no module, a `pin-source` that is not `file:` and an
    ///   absolute path). The message names attributes, never a `pin-value`
    ///   or a `pin-source` that is not a file path.
    public init(_ text: String) throws(HSMError) {
        redacted = PKCS11URI.redact(text)
        guard let uri = p11_kit_uri_new() else {
            throw HSMError(.invalidURI, "p11_kit_uri_new failed")
        }
        // Every throw below comes before `self.uri` is set, so `deinit` does
        // not run for a URI refused here (Swift runs it only for a fully
        // initialized object): free it on the way out instead.
        var kept = false
        defer { if !kept { p11_kit_uri_free(uri) } }
        let result = p11_kit_uri_parse(text, P11_KIT_URI_FOR_ANY, uri)
        guard result == P11_KIT_URI_OK.rawValue else {
            let reason = p11_kit_uri_message(result).map { String(cString: $0) } ?? "code \(result)"
            throw HSMError(.invalidURI, "token_uri \(redacted) is not a valid PKCS#11 URI (RFC 7512): \(reason)")
        }
        try PKCS11URI.checkAttributes(text)
        guard p11_kit_uri_any_unrecognized(uri) == 0 else {
            throw HSMError(.invalidURI, "token_uri \(redacted) has an attribute p11-kit does not recognize")
        }
        guard p11_kit_uri_get_slot_id(uri) == CK_SLOT_ID(bitPattern: -1) else {
            throw HSMError(.invalidURI, "token_uri selects a slot-id; select the token by token= (label) or serial= instead, because slot IDs change")
        }
        let info = p11_kit_uri_get_token_info(uri)!  // never nil: points into the URI
        let label = PKCS11URI.field(info.pointee.label)
        let serial = PKCS11URI.field(info.pointee.serialNumber)
        tokenLabel = label
        tokenSerial = serial
        guard label != nil || serial != nil else {
            throw HSMError(.invalidURI, "token_uri must select the token by token= (label) and/or serial=")
        }
        modulePath = p11_kit_uri_get_module_path(uri).map { String(cString: $0) }
        moduleName = p11_kit_uri_get_module_name(uri).map { String(cString: $0) }
        guard modulePath != nil || moduleName != nil else {
            throw HSMError(.invalidURI, "token_uri must name the PKCS#11 module: add ?module-path=/path/to/module.so or ?module-name=<p11-kit module name>")
        }
        pinSource = p11_kit_uri_get_pin_source(uri).map { String(cString: $0) }
        for (name, value) in [("module-path", modulePath), ("module-name", moduleName), ("pin-source", pinSource)] {
            if let value, PKCS11URI.mentionsPINValue(value) || value.contains(";") || value.contains("?") {
                throw HSMError(.invalidURI, "token_uri: the \(name) value holds \";\", \"?\" or a pin-value; separate query attributes with & (the value is not shown: it may hold a PIN)")
            }
        }
        if let pinSource, PKCS11URI.pinFilePath(pinSource) == nil {
            throw HSMError(.invalidURI, "token_uri: pin-source must be file:/absolute/path, the file that holds the PIN (the value given is not shown: it may be the PIN itself)")
        }
        hasPINValue = p11_kit_uri_get_pin_value(uri) != nil
        guard pinSource != nil || hasPINValue else {
            throw HSMError(.invalidURI, "token_uri must say where the PIN is: add pin-source=file:/path/to/pin")
        }
        guard pinSource == nil || !hasPINValue else {
            throw HSMError(.invalidURI, "token_uri has both pin-value and pin-source; keep one, preferably pin-source=file:/path/to/pin (which PIN to use would be ambiguous)")
        }
        self.uri = uri
        kept = true
    }

    deinit {
        p11_kit_uri_free(uri)
    }

    /// The redacted URI (``redacted``), so printing a URI never shows a `pin-value`.
    public var description: String { redacted }

    /// The library to load: `module-path`, else `module-name` resolved by p11-kit.
    /// - Throws: ``HSMError/Code/moduleNotFound``.
    public func resolveModulePath() throws(HSMError) -> String {
        if let modulePath { return modulePath }
        return try PKCS11Module.path(forRegisteredName: moduleName ?? "")
    }

    func matchTokenInfo(_ info: UnsafeMutablePointer<CK_TOKEN_INFO>) -> Bool {
        p11_kit_uri_match_token_info(uri, info) == 1
    }

    /// Reads the PIN: from `pin-value`, or from the `pin-source` file
    /// (`file:` URI or absolute path; one trailing newline, LF or CRLF, removed).
    /// - Returns: the PIN in a wiped buffer.
    /// - Throws: ``HSMError/Code/pinSourceUnreadable``;
    ///   ``HSMError/Code/pinSourceInsecure`` when the file is readable or
    ///   writable by other users, writable by its group, owned by
    ///   someone other than root and this process's effective uid, or below
    ///   a directory another user could change
    ///   (``PathSafety/unsafeDirectory(aboveWrittenOrResolved:)``, which
    ///   may enumerate the user database: call it from one thread at a
    ///   time, as signerd does at start and on reload).
    public func readPIN() throws(HSMError) -> SecureBytes {
        if let value = p11_kit_uri_get_pin_value(uri) {
            return SecureBytes(copying: UnsafeRawBufferPointer(start: value, count: strlen(value)))
        }
        guard let source = pinSource else {
            throw HSMError(.pinSourceUnreadable, "token_uri has no pin-source")
        }
        guard let path = PKCS11URI.pinFilePath(source) else {
            // init refuses such a source; never echo it: it may be the PIN itself.
            throw HSMError(.pinSourceUnreadable, "pin-source *** must be file:/absolute/path")
        }
        return try PKCS11URI.readPINFile(path)
    }

    /// Checks, without loading the module or touching the token, the files
    /// opening the token will need: a `module-path` library must be a
    /// readable regular file with an ELF header, and the PIN must read as ``readPIN()`` reads it
    /// (the copy read is wiped at once). A PIN file under `/run/credentials/`
    /// is left unchecked outside the service (systemd's `LoadCredential=`
    /// makes it only for the service's processes, which get
    /// `$CREDENTIALS_DIRECTORY`). A `module-name` is not resolved: that
    /// would load every module p11-kit knows; nor is a relative
    /// `module-path`, which p11-kit finds in its own module directory.
    /// For `signerd --check-config`.
    /// - Returns: what was left unchecked and why, for the operator; empty
    ///   when everything was checked.
    /// - Throws: ``HSMError/Code/moduleNotFound``, ``HSMError/Code/moduleInsecure``,
    ///   ``HSMError/Code/pinSourceUnreadable``, ``HSMError/Code/pinSourceInsecure``.
    public func checkFilesBeforeOpening() throws(HSMError) -> [String] {
        var unchecked: [String] = []
        if let modulePath, !modulePath.hasPrefix("/") {
            if let problem = PKCS11Module.insecurity(ofModule: modulePath) {
                throw HSMError(.moduleInsecure, problem)
            }
            // p11-kit looks for it in its own module directory (P11_MODULE_PATH), not the current one.
            unchecked.append("module-path=\(modulePath) is relative: p11-kit looks for it in its module directory only when the token is opened")
        } else if let modulePath {
            var info = stat()
            guard stat(modulePath, &info) == 0 else {
                throw HSMError(.moduleNotFound, "the PKCS#11 module \(modulePath) cannot be found: \(String(cString: strerror(errno)))")
            }
            guard (info.st_mode & S_IFMT) == S_IFREG, access(modulePath, R_OK) == 0 else {
                throw HSMError(.moduleNotFound, "the PKCS#11 module \(modulePath) is not a readable file")
            }
            // A shared library starts with the ELF magic number; anything else cannot be loaded.
            var magic = [UInt8](repeating: 0, count: 4)
            let fd = open(modulePath, O_RDONLY | O_CLOEXEC | O_NONBLOCK)
            let count = fd >= 0 ? read(fd, &magic, 4) : -1
            if fd >= 0 { close(fd) }
            guard count == 4, magic == [0x7F, 0x45, 0x4C, 0x46] else {
                throw HSMError(.moduleNotFound, "the PKCS#11 module \(modulePath) is not a shared library (no ELF header)")
            }
            if let problem = PKCS11Module.insecurity(ofModule: modulePath) {
                throw HSMError(.moduleInsecure, problem)
            }
        } else if let moduleName {
            unchecked.append("module-name=\(moduleName) is resolved by p11-kit only when the token is opened")
        }
        if p11_kit_uri_get_pin_value(uri) == nil, let path = pinSource.flatMap(PKCS11URI.pinFilePath),
           PKCS11URI.isSystemdCredential(path), getenv("CREDENTIALS_DIRECTORY") == nil {
            unchecked.append("the PIN file \(path) exists only inside the service (LoadCredential=); it is checked when the service starts")
        } else {
            _ = try readPIN()
        }
        return unchecked
    }

    /// Whether `path` is a copy systemd's `LoadCredential=` makes, under
    /// `/run/credentials/`, which exists only inside the service. The path
    /// is normalized first: `/run/credentials/../../etc/pin` is an ordinary file.
    /// - Parameter path: an absolute path.
    package static func isSystemdCredential(_ path: String) -> Bool {
        lexicallyNormalized(path).hasPrefix("/run/credentials/")
    }

    /// `path` with `.` and `..` components and repeated slashes resolved
    /// by name alone (symbolic links are not followed): `/a/./b/../c` is `/a/c`.
    static func lexicallyNormalized(_ path: String) -> String {
        var parts: [Substring] = []
        for part in path.split(separator: "/") where part != "." {
            if part == ".." { _ = parts.popLast() } else { parts.append(part) }
        }
        return "/" + parts.joined(separator: "/")
    }

    /// The PIN file a `pin-source` value names: `file:/abs`, `file:///abs`
    /// or a bare `/abs` path.
    /// - Parameter source: the `pin-source` value, percent-decoded.
    /// - Returns: the absolute path, or nil for anything else (such as a PIN
    ///   written where the path belongs), which must never be shown.
    package static func pinFilePath(_ source: String) -> String? {
        var path = source
        if path.hasPrefix("file://") {
            path = String(path.dropFirst(7))
        } else if path.hasPrefix("file:") {
            path = String(path.dropFirst(5))
        }
        return path.hasPrefix("/") ? path : nil
    }

    static func readPINFile(_ path: String) throws(HSMError) -> SecureBytes {
        // O_NONBLOCK: a FIFO would otherwise wait for a writer, for good (signerd blocks SIGTERM); fstat refuses it next.
        let fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK)
        guard fd >= 0 else {
            let reason = errno
            // ELOOP: the last component is a link (O_NOFOLLOW), or a loop of links in the directories above.
            var link = stat()
            if reason == ELOOP, lstat(path, &link) == 0, (link.st_mode & S_IFMT) == S_IFLNK {
                throw HSMError(.pinSourceUnreadable, "the PIN file \(path) is a symbolic link, which is not followed (whoever may change the link chooses the PIN sent); name the file itself")
            }
            throw HSMError(.pinSourceUnreadable, "cannot open the PIN file \(path): \(String(cString: strerror(reason)))")
        }
        defer { close(fd) }
        var info = stat()
        guard fstat(fd, &info) == 0, (info.st_mode & S_IFMT) == S_IFREG else {
            throw HSMError(.pinSourceUnreadable, "the PIN file \(path) is not a regular file")
        }
        // As OpenSSH's StrictModes: whoever may rewrite the file chooses the
        // PIN signerd sends, and a wrong one counts toward locking the token.
        guard info.st_mode & (S_IROTH | S_IWOTH | S_IWGRP) == 0 else {
            throw HSMError(.pinSourceInsecure, "the PIN file \(path) is readable or writable by other users, or writable by its group (mode \(String(info.st_mode & 0o777, radix: 8))); run chmod 0600 (or 0640 with the daemon's group) on it")
        }
        guard info.st_uid == 0 || info.st_uid == geteuid() else {
            var error = HSMError(.pinSourceInsecure, "the PIN file \(path) belongs to uid \(info.st_uid), neither root nor this process's uid \(geteuid()), so that user could change the PIN sent; chown it to root or to the user signerd runs as")
            error.fileOwner = UInt32(info.st_uid)
            throw error
        }
        if let problem = PathSafety.unsafeDirectory(aboveWrittenOrResolved: path) {
            throw HSMError(.pinSourceInsecure, "the PIN file \(path) lies below \(problem): that user could swap the file for one holding another PIN, and wrong PINs lock the token; keep it in a directory only root or this user may change, such as /etc/signerd")
        }
        let maximum = 256
        let pin = SecureBytes(capacity: maximum) { buffer in
            var total = 0
            while total < buffer.count {
                let n = read(fd, buffer.baseAddress! + total, buffer.count - total)  // capacity 256: non-nil
                if n < 0 && errno == EINTR { continue }
                if n <= 0 { break }
                total += n
            }
            if total > 0 && buffer[total - 1] == 0x0a { total -= 1 }
            if total > 0 && buffer[total - 1] == 0x0d { total -= 1 }
            return total
        }
        guard pin.count > 0 else {
            throw HSMError(.pinSourceUnreadable, "the PIN file \(path) is empty")
        }
        // Anything after the buffer (a second line after a 255-byte first one) is never sent as the PIN.
        var beyond: UInt8 = 0
        let more = read(fd, &beyond, 1)
        beyond = 0
        guard pin.count < maximum, more <= 0 else {
            throw HSMError(.pinSourceUnreadable, "the PIN file \(path) is longer than \(maximum - 1) bytes or holds more than one line")
        }
        // One line only: a second line is almost surely a mistake (two PINs, a
        // note), and a PIN the token refuses counts towards locking it.
        guard !pin.withUnsafeBytes({ $0.contains(0x0a) || $0.contains(0x0d) }) else {
            throw HSMError(.pinSourceUnreadable, "the PIN file \(path) holds more than one line; put the PIN alone on the first line")
        }
        // A byte-order mark (Notepad writes one) or a control byte (a tab, a NUL) is
        // almost surely not part of the PIN; sent as is, it would cost one of the
        // token's login tries. C_Login takes the PIN as CK_UTF8CHAR text (PKCS#11
        // since v2.10); spaces and UTF-8 letters stay allowed.
        guard !pin.withUnsafeBytes({ $0.count >= 3 && $0[0] == 0xef && $0[1] == 0xbb && $0[2] == 0xbf }) else {
            throw HSMError(.pinSourceUnreadable, "the PIN file \(path) starts with a UTF-8 byte-order mark (EF BB BF), which some editors write; save the file without one (nothing was sent to the token)")
        }
        guard !pin.withUnsafeBytes({ $0.contains { $0 < 0x20 || $0 == 0x7f } }) else {
            throw HSMError(.pinSourceUnreadable, "the PIN file \(path) holds a control character (a tab, a NUL or another byte below 0x20, or DEL); write the PIN alone, in printable characters (nothing was sent to the token)")
        }
        return pin
    }

    private static func field<T>(_ tuple: T) -> String? {
        withUnsafeBytes(of: tuple) { bytes in
            if bytes.allSatisfy({ $0 == 0 }) { return nil }
            var end = bytes.count
            while end > 0 && (bytes[end - 1] == 0x20 || bytes[end - 1] == 0) { end -= 1 }
            return String(decoding: bytes.prefix(end), as: UTF8.self)
        }
    }

    /// One `name=value` attribute of a URI, as ``attributes(of:)`` finds it.
    private struct Attribute {
        /// Where the attribute is in the text without whitespace.
        var range: Range<Int>
        /// The name: the bytes before the first `=`, as p11-kit compares them (not percent-decoded).
        var name: String
        /// Whether it is in the query (after `?`) rather than the path.
        var inQuery: Bool
    }

    /// Splits URI text into attributes the way `p11_kit_uri_parse` does:
    /// whitespace (space, CR, LF, VT) removed anywhere, the scheme up to the
    /// first `:`, path attributes separated by `;` up to `?` (an empty one
    /// ends the path), then query attributes separated by `&`. Works on any
    /// text, so that even a URI p11-kit refuses can be redacted.
    /// - Parameter text: the URI as written.
    /// - Returns: the text without whitespace, as bytes, and its attributes in order.
    private static func attributes(of text: String) -> (bytes: [UInt8], attributes: [Attribute]) {
        let bytes = text.utf8.filter { ![0x20, 0x0a, 0x0d, 0x0b].contains($0) }
        var found: [Attribute] = []
        func add(_ range: Range<Int>, inQuery: Bool) {
            let name = bytes[range].prefix { $0 != UInt8(ascii: "=") }
            found.append(Attribute(range: range, name: String(decoding: name, as: UTF8.self), inQuery: inQuery))
        }
        var index = (bytes.firstIndex(of: UInt8(ascii: ":")) ?? -1) + 1
        while true {
            let end = bytes[index...].firstIndex { $0 == UInt8(ascii: ";") || $0 == UInt8(ascii: "?") } ?? bytes.count
            if end == index { break }
            add(index..<end, inQuery: false)
            index = end
            if index == bytes.count || bytes[index] == UInt8(ascii: "?") { break }
            index += 1
        }
        while index < bytes.count {
            index += 1  // the `?`, `;` or `&` before the attribute
            let end = bytes[index...].firstIndex(of: UInt8(ascii: "&")) ?? bytes.count
            if end > index { add(index..<end, inQuery: true) }
            index = end
        }
        return (bytes, found)
    }

    /// Refuses what p11-kit accepts silently: an attribute it does not
    /// recognize, which it ignores (in the path it only sets
    /// `p11_kit_uri_any_unrecognized`; in the query it keeps a vendor
    /// attribute that nothing reads), and an attribute given twice, of which
    /// p11-kit keeps the last (`pinfile` counts as `pin-source`, its older name).
    /// - Parameter text: a URI p11-kit has parsed.
    /// - Throws: ``HSMError/Code/invalidURI`` naming the attribute (never its
    ///   value), or naming a token attribute longer than its `CK_TOKEN_INFO`
    ///   field (32 bytes for `token` and `manufacturer`, 16 for `model` and `serial`).
    private static func checkAttributes(_ text: String) throws(HSMError) {
        let query: Set<String> = ["pin-source", "pinfile", "pin-value", "module-name", "module-path"]  // p11-kit's parse_pin_query, parse_module_query
        let (bytes, found) = attributes(of: text)
        var seen: Set<String> = []
        for attribute in found {
            if !attribute.inQuery, let (limit, field) = tokenInfoFieldSizes[attribute.name] {
                let raw = String(decoding: bytes[attribute.range].drop { $0 != UInt8(ascii: "=") }.dropFirst(), as: UTF8.self)
                let length = (raw.removingPercentEncoding ?? raw).utf8.count
                guard length <= limit else {
                    throw HSMError(.invalidURI, "token_uri: \(attribute.name) is \(length) bytes long; PKCS#11 holds at most \(limit) bytes for it (CK_TOKEN_INFO \(field)), so no token can match")
                }
            }
            if attribute.inQuery ? !query.contains(attribute.name) : !recognizedInPath(String(decoding: bytes[attribute.range], as: UTF8.self)) {
                throw HSMError(.invalidURI, "token_uri has the \(attribute.inQuery ? "query" : "path") attribute \"\(attribute.name)\", which p11-kit does not recognize and would ignore; signerd reads token, serial, manufacturer and model in the path, module-path, module-name, pin-source and pin-value in the query")
            }
            let name = attribute.name == "pinfile" ? "pin-source" : attribute.name
            guard seen.insert(name).inserted else {
                throw HSMError(.invalidURI, "token_uri has \(name) more than once\(attribute.name == name ? "" : " (pinfile is another name for it)"); give each attribute once (p11-kit would use the last without a word)")
            }
        }
    }

    /// The token path attributes with their `CK_TOKEN_INFO` field sizes, in
    /// bytes (PKCS#11 2.40 §3.2): p11-kit leaves a longer value unrecognized.
    private static let tokenInfoFieldSizes: [String: (Int, String)] = [
        "token": (32, "label"), "manufacturer": (32, "manufacturerID"),
        "model": (16, "model"), "serial": (16, "serialNumber"),
    ]

    /// Whether p11-kit recognizes `attribute` (`name=value`) as a path attribute:
    /// parsed alone, it leaves `p11_kit_uri_any_unrecognized` unset.
    private static func recognizedInPath(_ attribute: String) -> Bool {
        // When it cannot tell (no memory), the whole URI's flag still decides.
        guard let single = p11_kit_uri_new() else { return true }
        defer { p11_kit_uri_free(single) }
        guard p11_kit_uri_parse("pkcs11:" + attribute, P11_KIT_URI_FOR_ANY, single) == P11_KIT_URI_OK.rawValue else { return true }
        return p11_kit_uri_any_unrecognized(single) == 0
    }

    /// Attribute names whose values are never secret and are shown as
    /// given: the token selectors and the module and PIN-file locations.
    private static let shownAttributes: Set<String> = [
        "token", "manufacturer", "serial", "model", "library-manufacturer", "library-description", "library-version",
        "slot-description", "slot-manufacturer", "slot-id", "id", "object", "type",
        "module-path", "module-name", "pin-source", "pinfile",
    ]

    /// The URI with the value of every attribute that is not known to be
    /// safe replaced by `***` (whitespace removed, as p11-kit does): an
    /// allow-list, so that `pin-value` in any spelling (`Pin-Value`,
    /// `pin%2Dvalue`, `pin_value`) and anything unknown stay hidden. A
    /// shown value that itself mentions a PIN value (`…so;pin-value=…`,
    /// a missing `&`) is hidden too, and so is a `pin-source` that is not a
    /// file path (a PIN written where the path belongs).
    private static func redact(_ text: String) -> String {
        let (bytes, found) = attributes(of: text)
        var out: [UInt8] = []
        var index = 0
        for attribute in found {
            let raw = String(decoding: bytes[attribute.range], as: UTF8.self)
            let value = raw.drop { $0 != "=" }.dropFirst()
            let isPINSource = attribute.name == "pin-source" || attribute.name == "pinfile"
            let shown = shownAttributes.contains(attribute.name) && raw.contains("=") && !mentionsPINValue(String(value))
                && (!isPINSource || pinFilePath(String(value).removingPercentEncoding ?? String(value)) != nil)
            guard !shown else { continue }
            out += bytes[index..<attribute.range.lowerBound]
            out += Array((raw.contains("=") ? "\(raw.prefix { $0 != "=" })=***" : "***").utf8)
            index = attribute.range.upperBound
        }
        out += bytes[index...]
        return String(decoding: out, as: UTF8.self)
    }

    /// Whether `text`, percent-decoded and in lower case, names a PIN value
    /// (`pin-value`, `pin_value`, `pinvalue`).
    static func mentionsPINValue(_ text: String) -> Bool {
        let plain = (text.removingPercentEncoding ?? text).lowercased()
        return plain.contains("pin-value") || plain.contains("pin_value") || plain.contains("pinvalue")
    }
}
