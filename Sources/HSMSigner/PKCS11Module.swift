// The PKCS#11 C surface: module loading through p11-kit, and every call into
// the function table, behind a seam (`PKCS11Interposer`) that tests use to
// inject CKR_* values. With PKCS11URI.swift, the only Swift files that
// import CPKCS11; no CK_* type leaves the module.
internal import CPKCS11
internal import CLibCrypto
import Synchronization

#if canImport(Glibc)
import Glibc
#endif

/// The PKCS#11 functions signerd calls, named as the standard names them.
package enum PKCS11Function: String, Sendable, CaseIterable {
    case initialize = "C_Initialize"
    case finalize = "C_Finalize"
    case getSlotList = "C_GetSlotList"
    case getTokenInfo = "C_GetTokenInfo"
    case openSession = "C_OpenSession"
    case closeSession = "C_CloseSession"
    case getSessionInfo = "C_GetSessionInfo"
    case login = "C_Login"
    case createObject = "C_CreateObject"
    case destroyObject = "C_DestroyObject"
    case getAttributeValue = "C_GetAttributeValue"
    case findObjectsInit = "C_FindObjectsInit"
    case findObjects = "C_FindObjects"
    case findObjectsFinal = "C_FindObjectsFinal"
    case signInit = "C_SignInit"
    case sign = "C_Sign"
    case initToken = "C_InitToken"
    case initPIN = "C_InitPIN"
    case setPIN = "C_SetPIN"
    case logout = "C_Logout"
}

/// The seam in front of the function table. Before each call signerd asks
/// the interposer; a non-nil answer is returned as if the module had
/// returned it, and the module is not called. An interposer may also block
/// (a hanging module) or count calls.
///
/// The production path has no interposer. Tests put one in front of a real
/// SoftHSM module, as swift-system mocks syscalls.
package protocol PKCS11Interposer: AnyObject, Sendable {
    /// Decides whether `function` reaches the module.
    /// - Parameters:
    ///   - function: the PKCS#11 function about to be called.
    ///   - session: the session handle it is called with (0 when none).
    /// - Returns: nil to call the module, or the `CK_RV` to return instead.
    func intercept(_ function: PKCS11Function, session: UInt) -> PKCS11ReturnValue?

    /// Sees the signature `C_Sign` returned, and may hand back another in
    /// its place (a module whose output has a given shape).
    /// - Parameter signature: the module's output, raw `r ‖ s`.
    /// - Returns: the bytes signerd is to take as the module's output.
    func signed(_ signature: [UInt8]) -> [UInt8]

    /// Sees the `flags` of `CK_TOKEN_INFO` that `C_GetTokenInfo` returned,
    /// and may hand back others (a token whose user PIN is locked, or on
    /// its final try).
    /// - Parameter flags: the module's `flags`.
    /// - Returns: the flags signerd is to take as the module's.
    func tokenFlags(_ flags: UInt) -> UInt
}

extension PKCS11Interposer {
    /// The module's own output, unchanged.
    package func signed(_ signature: [UInt8]) -> [UInt8] { signature }
    /// The module's own flags, unchanged.
    package func tokenFlags(_ flags: UInt) -> UInt { flags }
}

/// One loaded PKCS#11 module (a shared library and its function list),
/// initialized with `CKF_OS_LOCKING_OK`. Modules are shared per path in the
/// process: a library has one global state, so a second `C_Initialize`
/// would fail with `CKR_CRYPTOKI_ALREADY_INITIALIZED`.
final class PKCS11Module: @unchecked Sendable {
    // `list` is set once at load; the module's C state is protected by the
    // module itself (CKF_OS_LOCKING_OK). `initialized` is under `lock`.
    let list: UnsafeMutablePointer<CK_FUNCTION_LIST>
    /// The library path p11-kit loaded.
    let path: String
    private let lock = Locked<(users: Int, initialized: Bool)>((0, false))
    /// Calls now inside the function table (``enter()`` to ``leave()``).
    private let callsInside = Atomic<Int>(0)
    /// False while the module is finalized or being finalized: ``enter()``
    /// refuses, so no call starts under `C_Finalize`.
    private let accepting = Atomic<Bool>(false)

    /// How long `C_Finalize` waits for calls already inside the module to
    /// return, in microseconds; a call still inside then (a hung one) means
    /// the module is not finalized at all, since finalizing under a call is
    /// undefined behaviour (PKCS#11 v2.40 §5.4).
    static let finalizeWaitMicroseconds: useconds_t = 2_000_000

    private static let registry = Locked<[String: PKCS11Module]>([:])

    private init(list: UnsafeMutablePointer<CK_FUNCTION_LIST>, path: String) {
        self.list = list
        self.path = path
    }

    deinit {
        p11_kit_module_release(list)
    }

    /// Loads (or reuses) the module at `path` with p11-kit, unmanaged, and
    /// initializes it once.
    /// - Parameter path: an absolute path to a PKCS#11 shared library.
    /// - Throws: ``HSMError/Code/moduleNotFound``,
    ///   ``HSMError/Code/moduleInsecure`` (``insecurity(ofModule:)``), or a
    ///   `C_Initialize` failure.
    static func acquire(path: String) throws(HSMError) -> PKCS11Module {
        let module: PKCS11Module = try registry.withLock { (modules) throws(HSMError) -> PKCS11Module in
            if let existing = modules[path] { return existing }
            // A module missing now is not loaded later: in a sticky directory
            // (/var/tmp) any user could put a file there after the check.
            if path.hasPrefix("/"), access(path, F_OK) != 0 {
                throw HSMError(.moduleNotFound, "the PKCS#11 module \(path) cannot be found: \(String(cString: strerror(errno)))")
            }
            if let problem = insecurity(ofModule: path) {
                throw HSMError(.moduleInsecure, problem)
            }
            guard let list = p11_kit_module_load(path, Int32(P11_KIT_MODULE_UNMANAGED | P11_KIT_MODULE_CRITICAL)) else {
                throw HSMError(.moduleNotFound, "p11-kit could not load the PKCS#11 module \(path) (missing file, wrong architecture or unresolved symbols)")
            }
            let module = PKCS11Module(list: list, path: path)
            modules[path] = module
            return module
        }
        try module.retain()
        return module
    }

    /// Why the module at `path` may be changed by someone other than root
    /// and this process's user, or nil: the file (after symbolic links)
    /// owned by another user or writable by its group or others, or a
    /// directory on the way to it, through each symbolic link, that another
    /// user could change (``PathSafety/unsafeDirectory(above:)``). A path that cannot be
    /// resolved for another reason than a missing file (too long, a loop)
    /// is refused, since it could not be checked. A relative path is
    /// resolved by p11-kit in its own module directory; one that climbs out
    /// of it (`..`) is refused.
    /// - Parameter path: the `module-path` of the token URI.
    /// - Returns: a sentence naming the file or directory, its owner and mode.
    static func insecurity(ofModule path: String) -> String? {
        guard path.hasPrefix("/") else {
            guard !path.split(separator: "/").contains("..") else {
                return "module-path=\(path) is relative and climbs out of p11-kit's module directory with ..: not loaded; give the module's absolute path"
            }
            return nil
        }
        let fix = "not loaded: it and every directory above it must belong to root (or this user) and be writable by no one else"
        // Every directory on the way, link by link, before the file: when
        // they are safe, no one else can put a file where a missing one is
        // looked for later.
        if let problem = PathSafety.unsafeDirectory(above: path) {
            return "the PKCS#11 module \(path): \(problem); \(fix)"
        }
        guard let resolved = realpath(path, nil) else {
            // Missing included: a file made after the check would not be checked.
            return "the PKCS#11 module \(path) cannot be resolved to check who may change it (\(String(cString: strerror(errno)))): not loaded"
        }
        let file = String(cString: resolved)
        free(resolved)
        var info = stat()
        if stat(file, &info) == 0 {
            let mode = info.st_mode & 0o7777
            let what = "the PKCS#11 module \(file) (owner uid \(info.st_uid), mode \(String(mode, radix: 8)))"
            if info.st_uid != 0 && info.st_uid != geteuid() {
                return "\(what) belongs to another user than root and this one, who could change the code signerd and signctl load; \(fix)"
            }
            if mode & mode_t(S_IWOTH | S_IWGRP) != 0 {
                return "\(what) may be written by \(mode & mode_t(S_IWOTH) != 0 ? "other users" : "its group"), who could change the code signerd and signctl load; \(fix)"
            }
        }
        // The walk above went through every link to `file`: its directories are checked.
        return nil
    }

    /// Resolves a p11-kit registered module name (`module-name=softhsm2`)
    /// to its library path, through p11-kit's configuration.
    /// - Parameter name: the module's name in p11-kit's config (`/usr/share/p11-kit/modules/*.module`).
    /// - Returns: the library path.
    /// - Throws: ``HSMError/Code/moduleNotFound``.
    static func path(forRegisteredName name: String) throws(HSMError) -> String {
        guard let modules = p11_kit_modules_load(nil, Int32(P11_KIT_MODULE_UNMANAGED)) else {
            throw HSMError(.moduleNotFound, "p11-kit could not load its registered modules")
        }
        defer { p11_kit_modules_release(modules) }
        guard let module = p11_kit_module_for_name(modules, name),
              let filename = p11_kit_module_get_filename(module) else {
            throw HSMError(.moduleNotFound, "no PKCS#11 module named \(name) is registered with p11-kit (see `p11-kit list-modules`)")
        }
        defer { free(filename) }
        return String(cString: filename)
    }

    private func retain() throws(HSMError) {
        try lock.withLock { (state) throws(HSMError) in
            if !state.initialized {
                let rv = PKCS11Module.initialize(list)
                guard rv == .ok || rv == .cryptokiAlreadyInitialized else {
                    throw HSMError(pkcs11: .initialize, rv, message: "cannot initialize \(path)")
                }
                state.initialized = true
                accepting.store(true, ordering: .sequentiallyConsistent)
            }
            state.users += 1
        }
    }

    /// Admits one call into the function table, unless the module is
    /// finalized or being finalized; a true answer must be followed by
    /// ``leave()``. With ``finalizeQuietly()`` this keeps every call out
    /// from under `C_Finalize`: a call counted before `accepting` went
    /// false is waited for, one counted after sees it false.
    func enter() -> Bool {
        callsInside.add(1, ordering: .sequentiallyConsistent)
        guard accepting.load(ordering: .sequentiallyConsistent) else {
            callsInside.subtract(1, ordering: .sequentiallyConsistent)
            return false
        }
        return true
    }

    /// Ends a call ``enter()`` admitted.
    func leave() {
        callsInside.subtract(1, ordering: .sequentiallyConsistent)
    }

    /// Stops admitting calls and waits up to ``finalizeWaitMicroseconds``
    /// for those inside to return; then `C_Finalize`. Called under `lock`.
    /// - Returns: whether the module was finalized (false: a call stayed inside).
    private func finalizeQuietly() -> Bool {
        accepting.store(false, ordering: .sequentiallyConsistent)
        var waited: useconds_t = 0
        while callsInside.load(ordering: .sequentiallyConsistent) > 0 {
            guard waited < PKCS11Module.finalizeWaitMicroseconds else { return false }
            usleep(1_000)
            waited += 1_000
        }
        _ = list.pointee.C_Finalize(nil)
        return true
    }

    /// Drops one user; the last one finalizes the module, once no call is
    /// inside it (calls arriving meanwhile get `CKR_CRYPTOKI_NOT_INITIALIZED`).
    func release() {
        lock.withLock { state in
            state.users -= 1
            guard state.users == 0 && state.initialized else { return }
            state.initialized = false
            // A call still inside after the wait (hung in the module): the
            // module is left as it is; the process is about to exit.
            _ = finalizeQuietly()
        }
    }

    /// `C_Finalize` then `C_Initialize`: every session and login of the
    /// process on this module is gone afterwards. Used by token recovery.
    /// Refused with `CKR_CRYPTOKI_NOT_INITIALIZED` once the last user has
    /// released the module, and with `CKR_FUNCTION_FAILED` (the module
    /// left as it was) when a call stays inside past the wait.
    /// - Returns: the `C_Initialize` result.
    func reinitialize() -> PKCS11ReturnValue {
        lock.withLock { state in
            guard state.users > 0 else { return .cryptokiNotInitialized }
            guard finalizeQuietly() else {
                accepting.store(state.initialized, ordering: .sequentiallyConsistent)
                return .functionFailed
            }
            let rv = PKCS11Module.initialize(list)
            state.initialized = rv == .ok || rv == .cryptokiAlreadyInitialized
            accepting.store(state.initialized, ordering: .sequentiallyConsistent)
            return rv
        }
    }

    private static func initialize(_ list: UnsafeMutablePointer<CK_FUNCTION_LIST>) -> PKCS11ReturnValue {
        var arguments = CK_C_INITIALIZE_ARGS()
        arguments.flags = CK_FLAGS(CKF_OS_LOCKING_OK)
        return withUnsafeMutablePointer(to: &arguments) { pointer in
            PKCS11ReturnValue(rawValue: list.pointee.C_Initialize(pointer))
        }
    }
}

/// Calls into one module's function table, each through the seam.
///
/// Every method returns the `CK_RV` (never throws), so the caller decides
/// what each value means; ``HSMError`` is made where the decision is taken.
struct PKCS11Functions: @unchecked Sendable {
    // The module is shared and thread-safe (CKF_OS_LOCKING_OK); the
    // interposer is Sendable.
    let module: PKCS11Module
    let interposer: (any PKCS11Interposer)?

    private var list: UnsafeMutablePointer<CK_FUNCTION_LIST> { module.list }

    /// The most slots `C_GetSlotList` may report before the module is
    /// taken for broken (`CKR_GENERAL_ERROR`) rather than trusted to size
    /// an allocation.
    static let mostSlots: CK_ULONG = 4096

    /// The longest attribute value `C_GetAttributeValue` may report, in
    /// bytes, before the module is taken for broken (`CKR_GENERAL_ERROR`):
    /// signerd reads labels, IDs, EC parameters and points, all well under it.
    static let longestAttribute: CK_ULONG = 64 * 1024

    /// Runs `body`, which calls into the function table, inside the
    /// module's call gate (``PKCS11Module/enter()``); once the module is
    /// finalized, or while it is being finalized, returns `refused`
    /// (`CKR_CRYPTOKI_NOT_INITIALIZED`) without calling it.
    @inline(__always)
    private func gated<R>(_ refused: R, _ body: () -> R) -> R {
        guard module.enter() else { return refused }
        defer { module.leave() }
        return body()
    }

    @inline(__always)
    private func intercepted(_ function: PKCS11Function, _ session: UInt) -> PKCS11ReturnValue? {
        guard let interposer else { return nil }
        return interposer.intercept(function, session: session)
    }

    /// `C_GetSlotList(CK_TRUE, …)`: slots with a token present.
    func slotsWithToken() -> (PKCS11ReturnValue, [UInt]) {
        gated((.cryptokiNotInitialized, [])) {
            if let rv = intercepted(.getSlotList, 0) { return (rv, []) }
            for _ in 0..<4 {
                var count: UInt = 0
                var rv = PKCS11ReturnValue(rawValue: list.pointee.C_GetSlotList(CK_BBOOL(CK_TRUE), nil, &count))
                guard rv == .ok else { return (rv, []) }
                // A module's count is not trusted to size an allocation.
                guard count <= PKCS11Functions.mostSlots else { return (.generalError, []) }
                var slots = [UInt](repeating: 0, count: Int(count))
                rv = PKCS11ReturnValue(rawValue: list.pointee.C_GetSlotList(CK_BBOOL(CK_TRUE), &slots, &count))
                if rv == .bufferTooSmall { continue }  // a token appeared in between
                return (rv, Array(slots.prefix(Int(clamping: count))))
            }
            return (.bufferTooSmall, [])
        }
    }

    /// `C_GetTokenInfo`.
    func tokenInfo(slot: UInt) -> (PKCS11ReturnValue, TokenInfo?) {
        gated((.cryptokiNotInitialized, nil)) {
            if let rv = intercepted(.getTokenInfo, 0) { return (rv, nil) }
            var info = CK_TOKEN_INFO()
            let rv = PKCS11ReturnValue(rawValue: list.pointee.C_GetTokenInfo(CK_SLOT_ID(slot), &info))
            guard rv == .ok else { return (rv, nil) }
            var result = TokenInfo(info)
            if let interposer { result.flags = interposer.tokenFlags(result.flags) }
            return (rv, result)
        }
    }

    /// `C_OpenSession(slot, CKF_SERIAL_SESSION [| CKF_RW_SESSION])`.
    func openSession(slot: UInt, readWrite: Bool) -> (PKCS11ReturnValue, UInt) {
        gated((.cryptokiNotInitialized, 0)) {
            if let rv = intercepted(.openSession, 0) { return (rv, 0) }
            var session: CK_SESSION_HANDLE = 0
            let flags = CK_FLAGS(CKF_SERIAL_SESSION) | (readWrite ? CK_FLAGS(CKF_RW_SESSION) : 0)
            let rv = PKCS11ReturnValue(rawValue: list.pointee.C_OpenSession(CK_SLOT_ID(slot), flags, nil, nil, &session))
            return (rv, UInt(session))
        }
    }

    /// `C_GetSessionInfo`: whether a session is open in the module, and on
    /// which slot (what the module holds, whatever the pool believes).
    /// - Returns: `.ok` and the session's slot ID; the failure
    ///   (`CKR_SESSION_HANDLE_INVALID` for a number that is no open
    ///   session) and nil.
    func sessionSlot(_ session: UInt) -> (PKCS11ReturnValue, UInt?) {
        gated((.cryptokiNotInitialized, nil)) {
            if let rv = intercepted(.getSessionInfo, session) { return (rv, nil) }
            var info = CK_SESSION_INFO()
            let rv = PKCS11ReturnValue(rawValue: list.pointee.C_GetSessionInfo(CK_SESSION_HANDLE(session), &info))
            return rv == .ok ? (rv, UInt(info.slotID)) : (rv, nil)
        }
    }

    /// `C_Finalize` then `C_Initialize` on the module (``PKCS11Module/reinitialize()``),
    /// through the seam as `C_Finalize`.
    func reinitializeModule() -> PKCS11ReturnValue {
        if let rv = intercepted(.finalize, 0) { return rv }
        return module.reinitialize()
    }

    /// `C_CloseSession`.
    @discardableResult
    func closeSession(_ session: UInt) -> PKCS11ReturnValue {
        gated(.cryptokiNotInitialized) {
            if let rv = intercepted(.closeSession, session) { return rv }
            return PKCS11ReturnValue(rawValue: list.pointee.C_CloseSession(CK_SESSION_HANDLE(session)))
        }
    }

    /// `C_Login(session, CKU_USER, pin)`.
    func login(_ session: UInt, pin: SecureBytes) -> PKCS11ReturnValue {
        login(session, userType: CK_USER_TYPE(CKU_USER), pin: pin)
    }

    /// `C_Login(session, CKU_SO, soPIN)`.
    func loginSecurityOfficer(_ session: UInt, pin: SecureBytes) -> PKCS11ReturnValue {
        login(session, userType: CK_USER_TYPE(CKU_SO), pin: pin)
    }

    private func login(_ session: UInt, userType: CK_USER_TYPE, pin: SecureBytes) -> PKCS11ReturnValue {
        gated(.cryptokiNotInitialized) {
            if let rv = intercepted(.login, session) { return rv }
            return pin.withUnsafeBytes { bytes in
                PKCS11ReturnValue(rawValue: list.pointee.C_Login(
                    CK_SESSION_HANDLE(session), userType,
                    UnsafeMutablePointer(mutating: bytes.baseAddress?.assumingMemoryBound(to: UInt8.self)),
                    CK_ULONG(bytes.count)))
            }
        }
    }

    /// `C_Logout`.
    @discardableResult
    func logout(_ session: UInt) -> PKCS11ReturnValue {
        gated(.cryptokiNotInitialized) {
            if let rv = intercepted(.logout, session) { return rv }
            return PKCS11ReturnValue(rawValue: list.pointee.C_Logout(CK_SESSION_HANDLE(session)))
        }
    }

    /// `C_InitToken(slot, soPIN, label)`; the label is blank-padded to 32 bytes.
    func initToken(slot: UInt, soPIN: SecureBytes, label: String) -> PKCS11ReturnValue {
        gated(.cryptokiNotInitialized) {
            if let rv = intercepted(.initToken, 0) { return rv }
            var padded = [UInt8](repeating: 0x20, count: 32)
            for (index, byte) in label.utf8.prefix(32).enumerated() { padded[index] = byte }
            return soPIN.withUnsafeBytes { bytes in
                PKCS11ReturnValue(rawValue: list.pointee.C_InitToken(
                    CK_SLOT_ID(slot),
                    UnsafeMutablePointer(mutating: bytes.baseAddress?.assumingMemoryBound(to: UInt8.self)),
                    CK_ULONG(bytes.count), &padded))
            }
        }
    }

    /// `C_InitPIN(session, userPIN)` (the session is logged in as SO).
    func initPIN(_ session: UInt, pin: SecureBytes) -> PKCS11ReturnValue {
        gated(.cryptokiNotInitialized) {
            if let rv = intercepted(.initPIN, session) { return rv }
            return pin.withUnsafeBytes { bytes in
                PKCS11ReturnValue(rawValue: list.pointee.C_InitPIN(
                    CK_SESSION_HANDLE(session),
                    UnsafeMutablePointer(mutating: bytes.baseAddress?.assumingMemoryBound(to: UInt8.self)),
                    CK_ULONG(bytes.count)))
            }
        }
    }

    /// `C_SetPIN(session, oldPIN, newPIN)`: changes the PIN of the user
    /// logged in on `session` (a read-write session).
    func setPIN(_ session: UInt, old: SecureBytes, new: SecureBytes) -> PKCS11ReturnValue {
        gated(.cryptokiNotInitialized) {
            if let rv = intercepted(.setPIN, session) { return rv }
            return old.withUnsafeBytes { oldBytes in
                new.withUnsafeBytes { newBytes in
                    PKCS11ReturnValue(rawValue: list.pointee.C_SetPIN(
                        CK_SESSION_HANDLE(session),
                        UnsafeMutablePointer(mutating: oldBytes.baseAddress?.assumingMemoryBound(to: UInt8.self)), CK_ULONG(oldBytes.count),
                        UnsafeMutablePointer(mutating: newBytes.baseAddress?.assumingMemoryBound(to: UInt8.self)), CK_ULONG(newBytes.count)))
                }
            }
        }
    }

    /// `C_SignInit(session, CKM_ECDSA, key)` then `C_Sign` over `digest`.
    /// - Returns: the first failing `CK_RV` and which function returned it,
    ///   or `.ok` and the raw `r ‖ s` signature.
    func signECDSA(_ session: UInt, key: UInt, digest: [UInt8]) -> (PKCS11ReturnValue, PKCS11Function, [UInt8]) {
        gated((.cryptokiNotInitialized, .signInit, [])) {
            var rv: PKCS11ReturnValue
            if let injected = intercepted(.signInit, session) {
                rv = injected
            } else {
                var mechanism = CK_MECHANISM(mechanism: CK_MECHANISM_TYPE(CKM_ECDSA), pParameter: nil, ulParameterLen: 0)
                rv = PKCS11ReturnValue(rawValue: list.pointee.C_SignInit(CK_SESSION_HANDLE(session), &mechanism, CK_OBJECT_HANDLE(key)))
            }
            guard rv == .ok else { return (rv, .signInit, []) }
            if let injected = intercepted(.sign, session) {
                return (injected, .sign, [])
            }
            // 2 × 66 bytes: enough for any curve up to P-521.
            var signature = [UInt8](repeating: 0, count: 132)
            var length = CK_ULONG(signature.count)
            var input = digest
            rv = PKCS11ReturnValue(rawValue: list.pointee.C_Sign(CK_SESSION_HANDLE(session), &input, CK_ULONG(input.count), &signature, &length))
            guard rv == .ok else { return (rv, .sign, []) }
            let output = Array(signature.prefix(Int(clamping: length)))
            return (rv, .sign, interposer?.signed(output) ?? output)
        }
    }

    /// `C_FindObjectsInit`, `C_FindObjects` (in batches), `C_FindObjectsFinal`.
    func findObjects(_ session: UInt, template: [Attribute]) -> (PKCS11ReturnValue, PKCS11Function, [UInt]) {
        gated((.cryptokiNotInitialized, .findObjectsInit, [])) {
            if let rv = intercepted(.findObjectsInit, session) { return (rv, .findObjectsInit, []) }
            var rv = Attribute.withCTemplate(template) { pointer, count in
                PKCS11ReturnValue(rawValue: list.pointee.C_FindObjectsInit(CK_SESSION_HANDLE(session), pointer, CK_ULONG(count)))
            }
            guard rv == .ok else { return (rv, .findObjectsInit, []) }
            var found: [UInt] = []
            var failure: (PKCS11ReturnValue, PKCS11Function)?
            while true {
                if let injected = intercepted(.findObjects, session) {
                    failure = (injected, .findObjects)
                    break
                }
                var batch = [CK_OBJECT_HANDLE](repeating: 0, count: 32)
                var count: CK_ULONG = 0
                rv = PKCS11ReturnValue(rawValue: list.pointee.C_FindObjects(CK_SESSION_HANDLE(session), &batch, CK_ULONG(batch.count), &count))
                if rv != .ok {
                    failure = (rv, .findObjects)
                    break
                }
                found.append(contentsOf: batch.prefix(Int(clamping: count)).map { UInt($0) })
                if count < batch.count || found.count > 10_000 { break }
            }
            let finalRV = intercepted(.findObjectsFinal, session)
                ?? PKCS11ReturnValue(rawValue: list.pointee.C_FindObjectsFinal(CK_SESSION_HANDLE(session)))
            if let failure { return (failure.0, failure.1, []) }
            if finalRV != .ok { return (finalRV, .findObjectsFinal, []) }
            return (.ok, .findObjects, found)
        }
    }

    /// `C_GetAttributeValue` for one attribute's length only (`pValue`
    /// NULL): its value is never copied out of the module.
    /// - Returns: `.ok` and the length in bytes; `CKR_ATTRIBUTE_SENSITIVE`
    ///   (also for a length of `CK_UNAVAILABLE_INFORMATION`) or another
    ///   failure, and nil.
    func attributeLength(_ session: UInt, object: UInt, type: UInt) -> (PKCS11ReturnValue, Int?) {
        gated((.cryptokiNotInitialized, nil)) {
            if let rv = intercepted(.getAttributeValue, session) { return (rv, nil) }
            let (rv, length) = lengthQuery(session, object: object, type: type)
            return (rv, length.map { Int(clamping: $0) })
        }
    }

    /// The first, sizing `C_GetAttributeValue` call (`pValue` NULL), inside
    /// a caller's gate and after its interposer check.
    /// - Returns: `.ok` and the length; the failure, or
    ///   `CKR_ATTRIBUTE_SENSITIVE` for `CK_UNAVAILABLE_INFORMATION`, and nil.
    private func lengthQuery(_ session: UInt, object: UInt, type: UInt) -> (PKCS11ReturnValue, CK_ULONG?) {
        var query = CK_ATTRIBUTE(type: CK_ATTRIBUTE_TYPE(type), pValue: nil, ulValueLen: 0)
        let rv = PKCS11ReturnValue(rawValue: list.pointee.C_GetAttributeValue(CK_SESSION_HANDLE(session), CK_OBJECT_HANDLE(object), &query, 1))
        guard rv == .ok else { return (rv, nil) }
        if query.ulValueLen == CK_ULONG.max { return (.attributeSensitive, nil) }  // CK_UNAVAILABLE_INFORMATION
        return (rv, query.ulValueLen)
    }

    /// `C_GetAttributeValue` for one attribute, sized by a first call.
    /// - Returns: `.ok` and the bytes; `CKR_ATTRIBUTE_SENSITIVE` (or another
    ///   failure) and nil. A length of `CK_UNAVAILABLE_INFORMATION` maps to
    ///   `CKR_ATTRIBUTE_SENSITIVE`.
    func attribute(_ session: UInt, object: UInt, type: UInt) -> (PKCS11ReturnValue, [UInt8]?) {
        gated((.cryptokiNotInitialized, nil)) {
            if let rv = intercepted(.getAttributeValue, session) { return (rv, nil) }
            let (sized, length) = lengthQuery(session, object: object, type: type)
            guard let length else { return (sized, nil) }
            // A module's length is not trusted to size an allocation.
            guard length <= PKCS11Functions.longestAttribute else { return (.generalError, nil) }
            var value = [UInt8](repeating: 0, count: Int(length))
            // The template points into `value` only inside the closure.
            let (rv, written) = value.withUnsafeMutableBytes { buffer -> (PKCS11ReturnValue, CK_ULONG) in
                var query = CK_ATTRIBUTE(type: CK_ATTRIBUTE_TYPE(type), pValue: buffer.baseAddress, ulValueLen: length)
                let rv = PKCS11ReturnValue(rawValue: list.pointee.C_GetAttributeValue(CK_SESSION_HANDLE(session), CK_OBJECT_HANDLE(object), &query, 1))
                return (rv, query.ulValueLen)
            }
            guard rv == .ok else { return (rv, nil) }
            return (rv, Array(value.prefix(Int(clamping: written))))
        }
    }

    /// `C_CreateObject`.
    func createObject(_ session: UInt, template: [Attribute]) -> (PKCS11ReturnValue, UInt) {
        gated((.cryptokiNotInitialized, 0)) {
            if let rv = intercepted(.createObject, session) { return (rv, 0) }
            var handle: CK_OBJECT_HANDLE = 0
            let rv = Attribute.withCTemplate(template) { pointer, count in
                PKCS11ReturnValue(rawValue: list.pointee.C_CreateObject(CK_SESSION_HANDLE(session), pointer, CK_ULONG(count), &handle))
            }
            return (rv, UInt(handle))
        }
    }

    /// `C_DestroyObject`.
    func destroyObject(_ session: UInt, object: UInt) -> PKCS11ReturnValue {
        gated(.cryptokiNotInitialized) {
            if let rv = intercepted(.destroyObject, session) { return rv }
            return PKCS11ReturnValue(rawValue: list.pointee.C_DestroyObject(CK_SESSION_HANDLE(session), CK_OBJECT_HANDLE(object)))
        }
    }
}

/// What `C_GetTokenInfo` says of a token, blank padding removed.
struct TokenInfo: Sendable {
    var label: String
    var manufacturer: String
    var model: String
    var serial: String
    /// `ulMaxSessionCount`; nil when unlimited or unavailable.
    var maxSessions: Int?
    /// `ulMinPinLen` and `ulMaxPinLen`: the PIN lengths the token takes, in bytes.
    var pinLengths: ClosedRange<Int>
    var flags: UInt
    /// The raw structure, for p11-kit URI matching.
    fileprivate var raw: CK_TOKEN_INFO

    fileprivate init(_ info: CK_TOKEN_INFO) {
        raw = info
        label = TokenInfo.text(info.label)
        manufacturer = TokenInfo.text(info.manufacturerID)
        model = TokenInfo.text(info.model)
        serial = TokenInfo.text(info.serialNumber)
        let max = UInt(info.ulMaxSessionCount)
        maxSessions = (max == 0 || max == UInt.max) ? nil : Int(clamping: max)
        let shortest = Int(clamping: UInt(info.ulMinPinLen))
        pinLengths = shortest...Swift.max(shortest, Int(clamping: UInt(info.ulMaxPinLen)))
        flags = UInt(info.flags)
    }

    private static func text<T>(_ tuple: T) -> String {
        withUnsafeBytes(of: tuple) { bytes in
            var end = bytes.count
            while end > 0 && (bytes[end - 1] == 0x20 || bytes[end - 1] == 0) { end -= 1 }
            return String(decoding: bytes.prefix(end), as: UTF8.self)
        }
    }

    /// Whether the token matches the token part of `uri` (`p11_kit_uri_match_token_info`).
    func matches(_ uri: PKCS11URI) -> Bool {
        var copy = raw
        return uri.matchTokenInfo(&copy)
    }
}

/// A PKCS#11 attribute for templates: a type and its value, plain bytes or
/// a secret (the private scalar) that is only ever copied into wiped memory.
struct Attribute: Sendable {
    enum Value: Sendable {
        case bytes([UInt8])
        case secret(SecureBytes)
    }

    var type: UInt
    var value: Value

    init(_ type: UInt, _ value: [UInt8]) {
        self.type = type
        self.value = .bytes(value)
    }

    init(_ type: UInt, secret: SecureBytes) {
        self.type = type
        self.value = .secret(secret)
    }

    init(_ type: UInt, bool: Bool) {
        self.init(type, [bool ? UInt8(CK_TRUE) : UInt8(CK_FALSE)])
    }

    init(_ type: UInt, ulong: UInt) {
        self.init(type, withUnsafeBytes(of: CK_ULONG(ulong)) { Array($0) })
    }

    private func copy(into buffer: UnsafeMutableRawBufferPointer) {
        switch value {
        case .bytes(let bytes): bytes.withUnsafeBytes { buffer.copyMemory(from: $0) }
        case .secret(let secret): secret.withUnsafeBytes { buffer.copyMemory(from: $0) }
        }
    }

    private var count: Int {
        switch value {
        case .bytes(let bytes): bytes.count
        case .secret(let secret): secret.count
        }
    }

    /// Lends the attributes as a `CK_ATTRIBUTE` array for one call; the
    /// value copies are wiped and freed when `body` returns.
    static func withCTemplate<R>(_ template: [Attribute], _ body: (UnsafeMutablePointer<CK_ATTRIBUTE>?, Int) -> R) -> R {
        let storage = template.map { attribute -> UnsafeMutableRawBufferPointer in
            let buffer = UnsafeMutableRawBufferPointer.allocate(byteCount: max(attribute.count, 1), alignment: 8)
            attribute.copy(into: buffer)
            return buffer
        }
        defer {
            for buffer in storage {
                OPENSSL_cleanse(buffer.baseAddress, buffer.count)
                buffer.deallocate()
            }
        }
        var attributes = zip(template, storage).map { attribute, buffer in
            CK_ATTRIBUTE(type: CK_ATTRIBUTE_TYPE(attribute.type), pValue: buffer.baseAddress, ulValueLen: CK_ULONG(attribute.count))
        }
        return attributes.withUnsafeMutableBufferPointer { buffer in
            body(buffer.baseAddress, buffer.count)
        }
    }
}

/// The `CK_TOKEN_INFO` flags that tell how many wrong user PINs a token
/// has seen (PKCS#11 `C_GetTokenInfo`), checked before every `C_Login`.
package enum UserPINFlags {
    /// `CKF_USER_PIN_COUNT_LOW`: a wrong PIN was given since the last right one.
    package static let countLow = UInt(CKF_USER_PIN_COUNT_LOW)
    /// `CKF_USER_PIN_FINAL_TRY`: one more wrong PIN locks the PIN.
    package static let finalTry = UInt(CKF_USER_PIN_FINAL_TRY)
    /// `CKF_USER_PIN_LOCKED`: the user PIN is locked; only the SO can unlock it.
    package static let locked = UInt(CKF_USER_PIN_LOCKED)
}

/// PKCS#11 constants the rest of HSMSigner needs, without importing CPKCS11.
enum P11 {
    static let classAttribute = UInt(CKA_CLASS)
    static let keyType = UInt(CKA_KEY_TYPE)
    static let token = UInt(CKA_TOKEN)
    static let `private` = UInt(CKA_PRIVATE)
    static let label = UInt(CKA_LABEL)
    static let id = UInt(CKA_ID)
    static let sensitive = UInt(CKA_SENSITIVE)
    static let extractable = UInt(CKA_EXTRACTABLE)
    static let sign = UInt(CKA_SIGN)
    static let verify = UInt(CKA_VERIFY)
    static let signRecover = UInt(CKA_SIGN_RECOVER)
    static let decrypt = UInt(CKA_DECRYPT)
    static let encrypt = UInt(CKA_ENCRYPT)
    static let unwrap = UInt(CKA_UNWRAP)
    static let wrap = UInt(CKA_WRAP)
    static let derive = UInt(CKA_DERIVE)
    static let verifyRecover = UInt(CKA_VERIFY_RECOVER)
    static let modifiable = UInt(CKA_MODIFIABLE)
    static let value = UInt(CKA_VALUE)
    static let ecParams = UInt(CKA_EC_PARAMS)
    static let ecPoint = UInt(CKA_EC_POINT)
    static let privateKeyClass = UInt(CKO_PRIVATE_KEY)
    static let publicKeyClass = UInt(CKO_PUBLIC_KEY)
    static let secretKeyClass = UInt(CKO_SECRET_KEY)
    static let dataClass = UInt(CKO_DATA)
    static let application = UInt(CKA_APPLICATION)
    static let modulus = UInt(CKA_MODULUS)
    static let publicExponent = UInt(CKA_PUBLIC_EXPONENT)
    static let rsaKeyType = UInt(CKK_RSA)
    static let ecKeyType = UInt(CKK_EC)
    static let aesKeyType = UInt(CKK_AES)

    /// A `CKA_KEY_TYPE` value as an operator knows it (`RSA`, `EC`,
    /// `Ed25519/Ed448`, `AES`, `generic` for `CKK_GENERIC_SECRET`), or its
    /// number; `unknown-type` when unreadable.
    static func keyTypeName(_ type: UInt?) -> String {
        switch type {
        case .none: "an unknown-type"
        case UInt(CKK_RSA): "an RSA"
        case UInt(CKK_DSA): "a DSA"
        case UInt(CKK_DH): "a DH"
        case UInt(CKK_EC): "an EC"
        case UInt(CKK_EC_EDWARDS): "an Ed25519/Ed448"
        case UInt(CKK_AES): "an AES"
        case UInt(CKK_GENERIC_SECRET): "a generic"
        case .some(let other): "a key-type-\(other)"
        }
    }
    static let writeProtected = UInt(CKF_WRITE_PROTECTED)
    static let tokenInitialized = UInt(CKF_TOKEN_INITIALIZED)
    static let userPINInitialized = UInt(CKF_USER_PIN_INITIALIZED)
}
