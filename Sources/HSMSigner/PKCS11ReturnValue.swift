// The `CK_RV` of PKCS#11 as a raw-value struct, in swift-system's `Errno`
// style: vendor-defined values survive, and every known value prints its
// `CKR_*` name.

/// A PKCS#11 return value (`CK_RV`, PKCS#11 v2.40 §11.1 and §3.6).
///
/// Known values have named constants (``sessionHandleInvalid`` is
/// `CKR_SESSION_HANDLE_INVALID`); any other value, vendor-defined ones
/// (`CKR_VENDOR_DEFINED` and above) included, is kept as its raw number.
/// ``description`` gives the `CKR_*` name, or `CKR_VENDOR_DEFINED+0x…` /
/// `CKR_0x…` for values outside the standard table.
public struct PKCS11ReturnValue: RawRepresentable, Hashable, Sendable, CustomStringConvertible {
    /// The `CK_RV` number (an `unsigned long`).
    public var rawValue: UInt

    /// Wraps a raw `CK_RV`.
    /// - Parameter rawValue: the number a PKCS#11 function returned.
    public init(rawValue: UInt) {
        self.rawValue = rawValue
    }

    /// `CKR_VENDOR_DEFINED` (0x80000000): the first vendor-defined value.
    public static let vendorDefined = PKCS11ReturnValue(rawValue: 0x8000_0000)

    /// `CKR_OK`
    public static let ok = PKCS11ReturnValue(rawValue: 0)
    /// `CKR_CANCEL`
    public static let cancel = PKCS11ReturnValue(rawValue: 1)
    /// `CKR_HOST_MEMORY`
    public static let hostMemory = PKCS11ReturnValue(rawValue: 2)
    /// `CKR_SLOT_ID_INVALID`
    public static let slotIdInvalid = PKCS11ReturnValue(rawValue: 3)
    /// `CKR_GENERAL_ERROR`
    public static let generalError = PKCS11ReturnValue(rawValue: 5)
    /// `CKR_FUNCTION_FAILED`
    public static let functionFailed = PKCS11ReturnValue(rawValue: 6)
    /// `CKR_ARGUMENTS_BAD`
    public static let argumentsBad = PKCS11ReturnValue(rawValue: 7)
    /// `CKR_NO_EVENT`
    public static let noEvent = PKCS11ReturnValue(rawValue: 8)
    /// `CKR_NEED_TO_CREATE_THREADS`
    public static let needToCreateThreads = PKCS11ReturnValue(rawValue: 9)
    /// `CKR_CANT_LOCK`
    public static let cantLock = PKCS11ReturnValue(rawValue: 0xa)
    /// `CKR_ATTRIBUTE_READ_ONLY`
    public static let attributeReadOnly = PKCS11ReturnValue(rawValue: 0x10)
    /// `CKR_ATTRIBUTE_SENSITIVE`
    public static let attributeSensitive = PKCS11ReturnValue(rawValue: 0x11)
    /// `CKR_ATTRIBUTE_TYPE_INVALID`
    public static let attributeTypeInvalid = PKCS11ReturnValue(rawValue: 0x12)
    /// `CKR_ATTRIBUTE_VALUE_INVALID`
    public static let attributeValueInvalid = PKCS11ReturnValue(rawValue: 0x13)
    /// `CKR_ACTION_PROHIBITED`
    public static let actionProhibited = PKCS11ReturnValue(rawValue: 0x1b)
    /// `CKR_DATA_INVALID`
    public static let dataInvalid = PKCS11ReturnValue(rawValue: 0x20)
    /// `CKR_DATA_LEN_RANGE`
    public static let dataLenRange = PKCS11ReturnValue(rawValue: 0x21)
    /// `CKR_DEVICE_ERROR`
    public static let deviceError = PKCS11ReturnValue(rawValue: 0x30)
    /// `CKR_DEVICE_MEMORY`
    public static let deviceMemory = PKCS11ReturnValue(rawValue: 0x31)
    /// `CKR_DEVICE_REMOVED`
    public static let deviceRemoved = PKCS11ReturnValue(rawValue: 0x32)
    /// `CKR_ENCRYPTED_DATA_INVALID`
    public static let encryptedDataInvalid = PKCS11ReturnValue(rawValue: 0x40)
    /// `CKR_ENCRYPTED_DATA_LEN_RANGE`
    public static let encryptedDataLenRange = PKCS11ReturnValue(rawValue: 0x41)
    /// `CKR_FUNCTION_CANCELED`
    public static let functionCanceled = PKCS11ReturnValue(rawValue: 0x50)
    /// `CKR_FUNCTION_NOT_PARALLEL`
    public static let functionNotParallel = PKCS11ReturnValue(rawValue: 0x51)
    /// `CKR_FUNCTION_NOT_SUPPORTED`
    public static let functionNotSupported = PKCS11ReturnValue(rawValue: 0x54)
    /// `CKR_KEY_HANDLE_INVALID`
    public static let keyHandleInvalid = PKCS11ReturnValue(rawValue: 0x60)
    /// `CKR_KEY_SIZE_RANGE`
    public static let keySizeRange = PKCS11ReturnValue(rawValue: 0x62)
    /// `CKR_KEY_TYPE_INCONSISTENT`
    public static let keyTypeInconsistent = PKCS11ReturnValue(rawValue: 0x63)
    /// `CKR_KEY_NOT_NEEDED`
    public static let keyNotNeeded = PKCS11ReturnValue(rawValue: 0x64)
    /// `CKR_KEY_CHANGED`
    public static let keyChanged = PKCS11ReturnValue(rawValue: 0x65)
    /// `CKR_KEY_NEEDED`
    public static let keyNeeded = PKCS11ReturnValue(rawValue: 0x66)
    /// `CKR_KEY_INDIGESTIBLE`
    public static let keyIndigestible = PKCS11ReturnValue(rawValue: 0x67)
    /// `CKR_KEY_FUNCTION_NOT_PERMITTED`
    public static let keyFunctionNotPermitted = PKCS11ReturnValue(rawValue: 0x68)
    /// `CKR_KEY_NOT_WRAPPABLE`
    public static let keyNotWrappable = PKCS11ReturnValue(rawValue: 0x69)
    /// `CKR_KEY_UNEXTRACTABLE`
    public static let keyUnextractable = PKCS11ReturnValue(rawValue: 0x6a)
    /// `CKR_MECHANISM_INVALID`
    public static let mechanismInvalid = PKCS11ReturnValue(rawValue: 0x70)
    /// `CKR_MECHANISM_PARAM_INVALID`
    public static let mechanismParamInvalid = PKCS11ReturnValue(rawValue: 0x71)
    /// `CKR_OBJECT_HANDLE_INVALID`
    public static let objectHandleInvalid = PKCS11ReturnValue(rawValue: 0x82)
    /// `CKR_OPERATION_ACTIVE`
    public static let operationActive = PKCS11ReturnValue(rawValue: 0x90)
    /// `CKR_OPERATION_NOT_INITIALIZED`
    public static let operationNotInitialized = PKCS11ReturnValue(rawValue: 0x91)
    /// `CKR_PIN_INCORRECT`
    public static let pinIncorrect = PKCS11ReturnValue(rawValue: 0xa0)
    /// `CKR_PIN_INVALID`
    public static let pinInvalid = PKCS11ReturnValue(rawValue: 0xa1)
    /// `CKR_PIN_LEN_RANGE`
    public static let pinLenRange = PKCS11ReturnValue(rawValue: 0xa2)
    /// `CKR_PIN_EXPIRED`
    public static let pinExpired = PKCS11ReturnValue(rawValue: 0xa3)
    /// `CKR_PIN_LOCKED`
    public static let pinLocked = PKCS11ReturnValue(rawValue: 0xa4)
    /// `CKR_SESSION_CLOSED`
    public static let sessionClosed = PKCS11ReturnValue(rawValue: 0xb0)
    /// `CKR_SESSION_COUNT`
    public static let sessionCount = PKCS11ReturnValue(rawValue: 0xb1)
    /// `CKR_SESSION_HANDLE_INVALID`
    public static let sessionHandleInvalid = PKCS11ReturnValue(rawValue: 0xb3)
    /// `CKR_SESSION_PARALLEL_NOT_SUPPORTED`
    public static let sessionParallelNotSupported = PKCS11ReturnValue(rawValue: 0xb4)
    /// `CKR_SESSION_READ_ONLY`
    public static let sessionReadOnly = PKCS11ReturnValue(rawValue: 0xb5)
    /// `CKR_SESSION_EXISTS`
    public static let sessionExists = PKCS11ReturnValue(rawValue: 0xb6)
    /// `CKR_SESSION_READ_ONLY_EXISTS`
    public static let sessionReadOnlyExists = PKCS11ReturnValue(rawValue: 0xb7)
    /// `CKR_SESSION_READ_WRITE_SO_EXISTS`
    public static let sessionReadWriteSoExists = PKCS11ReturnValue(rawValue: 0xb8)
    /// `CKR_SIGNATURE_INVALID`
    public static let signatureInvalid = PKCS11ReturnValue(rawValue: 0xc0)
    /// `CKR_SIGNATURE_LEN_RANGE`
    public static let signatureLenRange = PKCS11ReturnValue(rawValue: 0xc1)
    /// `CKR_TEMPLATE_INCOMPLETE`
    public static let templateIncomplete = PKCS11ReturnValue(rawValue: 0xd0)
    /// `CKR_TEMPLATE_INCONSISTENT`
    public static let templateInconsistent = PKCS11ReturnValue(rawValue: 0xd1)
    /// `CKR_TOKEN_NOT_PRESENT`
    public static let tokenNotPresent = PKCS11ReturnValue(rawValue: 0xe0)
    /// `CKR_TOKEN_NOT_RECOGNIZED`
    public static let tokenNotRecognized = PKCS11ReturnValue(rawValue: 0xe1)
    /// `CKR_TOKEN_WRITE_PROTECTED`
    public static let tokenWriteProtected = PKCS11ReturnValue(rawValue: 0xe2)
    /// `CKR_UNWRAPPING_KEY_SIZE_RANGE`
    public static let unwrappingKeySizeRange = PKCS11ReturnValue(rawValue: 0xf1)
    /// `CKR_UNWRAPPING_KEY_TYPE_INCONSISTENT`
    public static let unwrappingKeyTypeInconsistent = PKCS11ReturnValue(rawValue: 0xf2)
    /// `CKR_USER_ALREADY_LOGGED_IN`
    public static let userAlreadyLoggedIn = PKCS11ReturnValue(rawValue: 0x100)
    /// `CKR_USER_NOT_LOGGED_IN`
    public static let userNotLoggedIn = PKCS11ReturnValue(rawValue: 0x101)
    /// `CKR_USER_PIN_NOT_INITIALIZED`
    public static let userPinNotInitialized = PKCS11ReturnValue(rawValue: 0x102)
    /// `CKR_USER_TYPE_INVALID`
    public static let userTypeInvalid = PKCS11ReturnValue(rawValue: 0x103)
    /// `CKR_USER_ANOTHER_ALREADY_LOGGED_IN`
    public static let userAnotherAlreadyLoggedIn = PKCS11ReturnValue(rawValue: 0x104)
    /// `CKR_USER_TOO_MANY_TYPES`
    public static let userTooManyTypes = PKCS11ReturnValue(rawValue: 0x105)
    /// `CKR_WRAPPED_KEY_INVALID`
    public static let wrappedKeyInvalid = PKCS11ReturnValue(rawValue: 0x110)
    /// `CKR_WRAPPED_KEY_LEN_RANGE`
    public static let wrappedKeyLenRange = PKCS11ReturnValue(rawValue: 0x112)
    /// `CKR_WRAPPING_KEY_HANDLE_INVALID`
    public static let wrappingKeyHandleInvalid = PKCS11ReturnValue(rawValue: 0x113)
    /// `CKR_WRAPPING_KEY_SIZE_RANGE`
    public static let wrappingKeySizeRange = PKCS11ReturnValue(rawValue: 0x114)
    /// `CKR_WRAPPING_KEY_TYPE_INCONSISTENT`
    public static let wrappingKeyTypeInconsistent = PKCS11ReturnValue(rawValue: 0x115)
    /// `CKR_RANDOM_SEED_NOT_SUPPORTED`
    public static let randomSeedNotSupported = PKCS11ReturnValue(rawValue: 0x120)
    /// `CKR_RANDOM_NO_RNG`
    public static let randomNoRng = PKCS11ReturnValue(rawValue: 0x121)
    /// `CKR_DOMAIN_PARAMS_INVALID`
    public static let domainParamsInvalid = PKCS11ReturnValue(rawValue: 0x130)
    /// `CKR_CURVE_NOT_SUPPORTED`
    public static let curveNotSupported = PKCS11ReturnValue(rawValue: 0x140)
    /// `CKR_BUFFER_TOO_SMALL`
    public static let bufferTooSmall = PKCS11ReturnValue(rawValue: 0x150)
    /// `CKR_SAVED_STATE_INVALID`
    public static let savedStateInvalid = PKCS11ReturnValue(rawValue: 0x160)
    /// `CKR_INFORMATION_SENSITIVE`
    public static let informationSensitive = PKCS11ReturnValue(rawValue: 0x170)
    /// `CKR_STATE_UNSAVEABLE`
    public static let stateUnsaveable = PKCS11ReturnValue(rawValue: 0x180)
    /// `CKR_CRYPTOKI_NOT_INITIALIZED`
    public static let cryptokiNotInitialized = PKCS11ReturnValue(rawValue: 0x190)
    /// `CKR_CRYPTOKI_ALREADY_INITIALIZED`
    public static let cryptokiAlreadyInitialized = PKCS11ReturnValue(rawValue: 0x191)
    /// `CKR_MUTEX_BAD`
    public static let mutexBad = PKCS11ReturnValue(rawValue: 0x1a0)
    /// `CKR_MUTEX_NOT_LOCKED`
    public static let mutexNotLocked = PKCS11ReturnValue(rawValue: 0x1a1)
    /// `CKR_NEW_PIN_MODE`
    public static let newPinMode = PKCS11ReturnValue(rawValue: 0x1b0)
    /// `CKR_NEXT_OTP`
    public static let nextOtp = PKCS11ReturnValue(rawValue: 0x1b1)
    /// `CKR_EXCEEDED_MAX_ITERATIONS`
    public static let exceededMaxIterations = PKCS11ReturnValue(rawValue: 0x1c0)
    /// `CKR_FIPS_SELF_TEST_FAILED`
    public static let fipsSelfTestFailed = PKCS11ReturnValue(rawValue: 0x1c1)
    /// `CKR_LIBRARY_LOAD_FAILED`
    public static let libraryLoadFailed = PKCS11ReturnValue(rawValue: 0x1c2)
    /// `CKR_PIN_TOO_WEAK`
    public static let pinTooWeak = PKCS11ReturnValue(rawValue: 0x1c3)
    /// `CKR_PUBLIC_KEY_INVALID`
    public static let publicKeyInvalid = PKCS11ReturnValue(rawValue: 0x1c4)
    /// `CKR_FUNCTION_REJECTED`
    public static let functionRejected = PKCS11ReturnValue(rawValue: 0x200)

    /// The `CKR_*` name of this value, e.g. `CKR_PIN_INCORRECT`.
    public var name: String {
        if let known = Self.names[rawValue] {
            return known
        }
        if rawValue >= Self.vendorDefined.rawValue {
            return "CKR_VENDOR_DEFINED+0x" + String(rawValue - Self.vendorDefined.rawValue, radix: 16)
        }
        return "CKR_0x" + String(rawValue, radix: 16)
    }

    /// Same as ``name``.
    public var description: String { name }

    /// The value a `CKR_*` name from PKCS#11's list stands for.
    /// - Parameter name: e.g. `CKR_DEVICE_REMOVED`.
    /// - Returns: nil for anything else (vendor-defined values and
    ///   signerd's own conditions such as `key_vanished` included).
    public init?(name: String) {
        guard name.hasPrefix("CKR_"), let value = Self.values[name] else { return nil }
        self.init(rawValue: value)
    }

    private static let values: [String: UInt] = Dictionary(uniqueKeysWithValues: names.map { ($0.value, $0.key) })

    private static let names: [UInt: String] = [
        0: "CKR_OK",
        1: "CKR_CANCEL",
        2: "CKR_HOST_MEMORY",
        3: "CKR_SLOT_ID_INVALID",
        5: "CKR_GENERAL_ERROR",
        6: "CKR_FUNCTION_FAILED",
        7: "CKR_ARGUMENTS_BAD",
        8: "CKR_NO_EVENT",
        9: "CKR_NEED_TO_CREATE_THREADS",
        0xa: "CKR_CANT_LOCK",
        0x10: "CKR_ATTRIBUTE_READ_ONLY",
        0x11: "CKR_ATTRIBUTE_SENSITIVE",
        0x12: "CKR_ATTRIBUTE_TYPE_INVALID",
        0x13: "CKR_ATTRIBUTE_VALUE_INVALID",
        0x1b: "CKR_ACTION_PROHIBITED",
        0x20: "CKR_DATA_INVALID",
        0x21: "CKR_DATA_LEN_RANGE",
        0x30: "CKR_DEVICE_ERROR",
        0x31: "CKR_DEVICE_MEMORY",
        0x32: "CKR_DEVICE_REMOVED",
        0x40: "CKR_ENCRYPTED_DATA_INVALID",
        0x41: "CKR_ENCRYPTED_DATA_LEN_RANGE",
        0x50: "CKR_FUNCTION_CANCELED",
        0x51: "CKR_FUNCTION_NOT_PARALLEL",
        0x54: "CKR_FUNCTION_NOT_SUPPORTED",
        0x60: "CKR_KEY_HANDLE_INVALID",
        0x62: "CKR_KEY_SIZE_RANGE",
        0x63: "CKR_KEY_TYPE_INCONSISTENT",
        0x64: "CKR_KEY_NOT_NEEDED",
        0x65: "CKR_KEY_CHANGED",
        0x66: "CKR_KEY_NEEDED",
        0x67: "CKR_KEY_INDIGESTIBLE",
        0x68: "CKR_KEY_FUNCTION_NOT_PERMITTED",
        0x69: "CKR_KEY_NOT_WRAPPABLE",
        0x6a: "CKR_KEY_UNEXTRACTABLE",
        0x70: "CKR_MECHANISM_INVALID",
        0x71: "CKR_MECHANISM_PARAM_INVALID",
        0x82: "CKR_OBJECT_HANDLE_INVALID",
        0x90: "CKR_OPERATION_ACTIVE",
        0x91: "CKR_OPERATION_NOT_INITIALIZED",
        0xa0: "CKR_PIN_INCORRECT",
        0xa1: "CKR_PIN_INVALID",
        0xa2: "CKR_PIN_LEN_RANGE",
        0xa3: "CKR_PIN_EXPIRED",
        0xa4: "CKR_PIN_LOCKED",
        0xb0: "CKR_SESSION_CLOSED",
        0xb1: "CKR_SESSION_COUNT",
        0xb3: "CKR_SESSION_HANDLE_INVALID",
        0xb4: "CKR_SESSION_PARALLEL_NOT_SUPPORTED",
        0xb5: "CKR_SESSION_READ_ONLY",
        0xb6: "CKR_SESSION_EXISTS",
        0xb7: "CKR_SESSION_READ_ONLY_EXISTS",
        0xb8: "CKR_SESSION_READ_WRITE_SO_EXISTS",
        0xc0: "CKR_SIGNATURE_INVALID",
        0xc1: "CKR_SIGNATURE_LEN_RANGE",
        0xd0: "CKR_TEMPLATE_INCOMPLETE",
        0xd1: "CKR_TEMPLATE_INCONSISTENT",
        0xe0: "CKR_TOKEN_NOT_PRESENT",
        0xe1: "CKR_TOKEN_NOT_RECOGNIZED",
        0xe2: "CKR_TOKEN_WRITE_PROTECTED",
        0xf1: "CKR_UNWRAPPING_KEY_SIZE_RANGE",
        0xf2: "CKR_UNWRAPPING_KEY_TYPE_INCONSISTENT",
        0x100: "CKR_USER_ALREADY_LOGGED_IN",
        0x101: "CKR_USER_NOT_LOGGED_IN",
        0x102: "CKR_USER_PIN_NOT_INITIALIZED",
        0x103: "CKR_USER_TYPE_INVALID",
        0x104: "CKR_USER_ANOTHER_ALREADY_LOGGED_IN",
        0x105: "CKR_USER_TOO_MANY_TYPES",
        0x110: "CKR_WRAPPED_KEY_INVALID",
        0x112: "CKR_WRAPPED_KEY_LEN_RANGE",
        0x113: "CKR_WRAPPING_KEY_HANDLE_INVALID",
        0x114: "CKR_WRAPPING_KEY_SIZE_RANGE",
        0x115: "CKR_WRAPPING_KEY_TYPE_INCONSISTENT",
        0x120: "CKR_RANDOM_SEED_NOT_SUPPORTED",
        0x121: "CKR_RANDOM_NO_RNG",
        0x130: "CKR_DOMAIN_PARAMS_INVALID",
        0x140: "CKR_CURVE_NOT_SUPPORTED",
        0x150: "CKR_BUFFER_TOO_SMALL",
        0x160: "CKR_SAVED_STATE_INVALID",
        0x170: "CKR_INFORMATION_SENSITIVE",
        0x180: "CKR_STATE_UNSAVEABLE",
        0x190: "CKR_CRYPTOKI_NOT_INITIALIZED",
        0x191: "CKR_CRYPTOKI_ALREADY_INITIALIZED",
        0x1a0: "CKR_MUTEX_BAD",
        0x1a1: "CKR_MUTEX_NOT_LOCKED",
        0x1b0: "CKR_NEW_PIN_MODE",
        0x1b1: "CKR_NEXT_OTP",
        0x1c0: "CKR_EXCEEDED_MAX_ITERATIONS",
        0x1c1: "CKR_FIPS_SELF_TEST_FAILED",
        0x1c2: "CKR_LIBRARY_LOAD_FAILED",
        0x1c3: "CKR_PIN_TOO_WEAK",
        0x1c4: "CKR_PUBLIC_KEY_INVALID",
        0x200: "CKR_FUNCTION_REJECTED",
    ]
}
