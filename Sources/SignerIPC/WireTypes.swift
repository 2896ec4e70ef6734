// The wire contract (API contract v1): request and response bodies, shared
// by signerd, signctl and the tests. Field names are snake_case on the wire.
import Foundation
import HSMSigner

/// `POST /v1/sign/promotional-offer` request.
public struct PromotionalOfferRequest: Codable, Sendable, Equatable {
    /// The member names the request body may carry (built once, not per request).
    static let fields: Set<String> = ["bundle_id", "key_id", "product_id", "offer_id", "app_account_token", "nonce", "timestamp"]
    /// What `timestamp` must be, said for a number beyond the 64-bit range
    /// (the window `AppleFields.checkTimestamp` enforces).
    static let integerRanges = ["timestamp": "UNIX time in milliseconds (13 digits), within the last 24 hours and at most 5 minutes ahead"]

    /// The app's bundle ID (required).
    public var bundleID: String
    /// The key ID; optional when exactly one key (or the default key) serves the bundle.
    public var keyID: String?
    /// The subscription's product identifier (required).
    public var productID: String
    /// The promotional offer identifier (required).
    public var offerID: String
    /// Empty or a UUID in any case; signed lowercase. Default empty.
    public var appAccountToken: String?
    /// A UUID in any case; default a fresh UUID v4.
    public var nonce: String?
    /// UNIX time in milliseconds; default now.
    public var timestamp: Int64?

    enum CodingKeys: String, CodingKey {
        case bundleID = "bundle_id", keyID = "key_id", productID = "product_id", offerID = "offer_id"
        case appAccountToken = "app_account_token", nonce, timestamp
    }

    /// Makes a request.
    public init(bundleID: String, keyID: String? = nil, productID: String, offerID: String,
                appAccountToken: String? = nil, nonce: String? = nil, timestamp: Int64? = nil) {
        self.bundleID = bundleID
        self.keyID = keyID
        self.productID = productID
        self.offerID = offerID
        self.appAccountToken = appAccountToken
        self.nonce = nonce
        self.timestamp = timestamp
    }

    /// Parses a request body with the contract's field errors.
    /// - Throws: ``APIError`` `invalid_json`, `missing_field`, `invalid_field`, `unknown_field`.
    public init(body: [UInt8]) throws(APIError) {
        var reader = try FieldReader(json: body, allowed: Self.fields, integerRanges: Self.integerRanges)
        bundleID = try reader.string("bundle_id", "the app's bundle ID")
        keyID = try reader.optionalString("key_id")
        productID = try reader.string("product_id", "the subscription's product identifier")
        offerID = try reader.string("offer_id", "the promotional offer identifier from App Store Connect")
        appAccountToken = try reader.optionalString("app_account_token")
        nonce = try reader.optionalString("nonce")
        timestamp = try reader.optionalInteger("timestamp", "UNIX time in milliseconds")
        try reader.finish()
    }
}

/// `POST /v1/sign/promotional-offer` response: exactly the values signed.
public struct PromotionalOfferResponse: Codable, Sendable, Equatable {
    /// The key that signed.
    public var keyID: String
    /// The app account token signed (`app_account_token`): lowercase, or
    /// "" when none was sent. The contract: "signed lowercase and returned
    /// as signed"; the app must set this same value on the purchase.
    public var appAccountToken: String
    /// The lowercase nonce signed.
    public var nonce: String
    /// The timestamp signed, milliseconds.
    public var timestamp: Int64
    /// Standard padded Base64 of the DER ECDSA signature (96 characters for most signatures).
    public var signature: String

    enum CodingKeys: String, CodingKey {
        case keyID = "key_id", appAccountToken = "app_account_token", nonce, timestamp, signature
    }

    /// Makes a response.
    public init(keyID: String, appAccountToken: String = "", nonce: String, timestamp: Int64, signature: String) {
        self.keyID = keyID
        self.appAccountToken = appAccountToken
        self.nonce = nonce
        self.timestamp = timestamp
        self.signature = signature
    }
}

/// `POST /v1/offers` request, in the RevenueCat SDK's offer format.
public struct OffersRequest: Codable, Sendable, Equatable {
    /// The member names the request body may carry (built once, not per request).
    /// `fetch_token` (the SDK's App Store receipt, or null) is accepted and
    /// ignored, so a body the SDK sent can be passed on as it is.
    static let fields: Set<String> = ["bundle_id", "app_user_id", "fetch_token", "generate_offers"]

    /// The member names each `generate_offers` entry may carry (built once, not per request).
    static let offerFields: Set<String> = ["offer_id", "product_id", "subscription_group"]

    /// One offer to sign.
    public struct Offer: Codable, Sendable, Equatable {
        /// The promotional offer identifier.
        public var offerID: String
        /// The product identifier.
        public var productID: String
        /// Sent by the SDK and ignored (kept when it is a string).
        public var subscriptionGroup: String?
        /// Why this entry cannot be signed (a missing or mistyped member, or
        /// an identifier breaking the field rules), found while parsing; the other offers are signed anyway
        /// and this one is answered with a `signature_error`. Then
        /// ``offerID`` and ``productID`` hold what was sent when it was a
        /// string, else "". Not part of the wire format.
        public var problem: APIError? = nil

        enum CodingKeys: String, CodingKey {
            case offerID = "offer_id", productID = "product_id", subscriptionGroup = "subscription_group"
        }

        /// Makes an offer entry.
        public init(offerID: String, productID: String, subscriptionGroup: String? = nil) {
            self.offerID = offerID
            self.productID = productID
            self.subscriptionGroup = subscriptionGroup
        }
    }

    /// The app's bundle ID.
    public var bundleID: String
    /// The app user ID: signed as the app account token when it is a UUID, else an empty token is signed.
    public var appUserID: String
    /// 1–50 offers.
    public var generateOffers: [Offer]

    /// The most offers in one request.
    public static let maximumOffers = 50

    enum CodingKeys: String, CodingKey {
        case bundleID = "bundle_id", appUserID = "app_user_id", generateOffers = "generate_offers"
    }

    /// Makes a request.
    public init(bundleID: String, appUserID: String, generateOffers: [Offer]) {
        self.bundleID = bundleID
        self.appUserID = appUserID
        self.generateOffers = generateOffers
    }

    /// Parses a request body. The contract has each offer succeed or fail on
    /// its own, so a problem with the values of one `generate_offers` entry
    /// (a missing or mistyped member, an identifier breaking the field
    /// rules) is kept in that entry's ``Offer/problem`` instead of failing
    /// the request. An unknown member is refused as in every request.
    /// - Throws: ``APIError`` naming the field for a problem of the request
    ///   itself: its top-level members, `generate_offers` not an array of
    ///   1–50 entries, an entry that is not a JSON object, or
    ///   `unknown_field` for an entry member that is not `offer_id`,
    ///   `product_id` or `subscription_group`.
    public init(body: [UInt8]) throws(APIError) {
        // No number in this request is ever signed: one beyond Int64 fails
        // only the field or entry that holds it, not the batch.
        var reader = try FieldReader(json: body, allowed: Self.fields, exactNumbers: false)
        // An unknown member is a typo (`productId`), which the contract
        // refuses for the whole request, entries included, before any other
        // problem (400 `unknown_field`); a value that breaks a rule stays the
        // entry's own.
        try reader.refuseUnknownInEntries(of: "generate_offers", allowed: Self.offerFields)
        bundleID = try reader.string("bundle_id", "the app's bundle ID")
        appUserID = try reader.optionalString("app_user_id") ?? ""
        let entries = try reader.array("generate_offers")
        reader.ignore("fetch_token")
        try reader.finish()
        guard (1...Self.maximumOffers).contains(entries.count) else {
            throw APIError(.invalidField, "generate_offers must hold 1 to \(Self.maximumOffers) offers; got \(entries.count)", field: "generate_offers")
        }
        var offers: [Offer] = []
        for (index, entry) in entries.enumerated() {
            guard case .object(let members) = entry else {
                throw APIError(.invalidField, "generate_offers[\(index)] must be an object with offer_id and product_id", field: "generate_offers[\(index)]")
            }
            offers.append(Self.offer(members, path: "generate_offers[\(index)]."))
        }
        generateOffers = offers
    }

    /// One entry of `generate_offers`, whose member names
    /// ``FieldReader/refuseUnknownInEntries(of:allowed:)`` already checked,
    /// or what is wrong with its values.
    private static func offer(_ members: [String: JSONValue], path: String) -> Offer {
        // `subscription_group` is ignored whatever its type (the contract); a string is kept.
        var group: String?
        if case .string(let value)? = members["subscription_group"] { group = value }
        var reader = FieldReader(checked: members, path: path)
        do throws(APIError) {
            let offerID = try reader.string("offer_id")
            let productID = try reader.string("product_id")
            reader.ignore("subscription_group")
            try reader.finish()
            do {
                try AppleFields.checkIdentifier(productID, field: path + "product_id")
                try AppleFields.checkIdentifier(offerID, field: path + "offer_id")
            } catch {
                throw APIError(error)
            }
            return Offer(offerID: offerID, productID: productID, subscriptionGroup: group)
        } catch {
            func sent(_ name: String) -> String {
                if case .string(let value)? = members[name] { return value }
                return ""
            }
            var offer = Offer(offerID: sent("offer_id"), productID: sent("product_id"), subscriptionGroup: group)
            offer.problem = error
            return offer
        }
    }
}

/// `POST /v1/offers` response: one entry per requested offer, in order.
public struct OffersResponse: Codable, Sendable, Equatable {
    /// The signed values of one offer.
    public struct SignatureData: Codable, Sendable, Equatable {
        /// The nonce signed, a lowercase UUID (`nonce`).
        public var nonce: String
        /// Standard padded Base64 of the DER ECDSA signature (`signature`), as in
        /// ``PromotionalOfferResponse/signature``.
        public var signature: String
        /// The timestamp signed, UNIX time in milliseconds (`timestamp`).
        public var timestamp: Int64
        /// Makes the signed values.
        public init(nonce: String, signature: String, timestamp: Int64) {
            self.nonce = nonce
            self.signature = signature
            self.timestamp = timestamp
        }
    }

    /// Why one offer was not signed (RevenueCat backend error codes: 7234 =
    /// no usable In-App Purchase key for the bundle, 7226 = the offer entry
    /// breaks a field rule).
    public struct SignatureError: Codable, Sendable, Equatable {
        /// The RevenueCat backend error code (`code`), e.g. ``OffersResponse/noKeyCode``.
        public var code: Int
        /// A sentence for people (`message`).
        public var message: String
        /// Makes an offer error.
        public init(code: Int, message: String) {
            self.code = code
            self.message = message
        }
    }

    /// One offer's outcome: `signature_data` or `signature_error`.
    public struct Offer: Codable, Sendable, Equatable {
        /// The key that signed (`key_id`); absent when the offer was not signed.
        public var keyID: String?
        /// The promotional offer identifier, as requested (`offer_id`).
        public var offerID: String
        /// The product identifier, as requested (`product_id`).
        public var productID: String
        /// The signed values (`signature_data`); absent when the offer failed.
        public var signatureData: SignatureData?
        /// Why the offer was not signed (`signature_error`); absent when it was.
        public var signatureError: SignatureError?

        enum CodingKeys: String, CodingKey {
            case keyID = "key_id", offerID = "offer_id", productID = "product_id"
            case signatureData = "signature_data", signatureError = "signature_error"
        }

        /// Makes an outcome; give one of `signatureData` and `signatureError`.
        public init(keyID: String?, offerID: String, productID: String, signatureData: SignatureData?, signatureError: SignatureError?) {
            self.keyID = keyID
            self.offerID = offerID
            self.productID = productID
            self.signatureData = signatureData
            self.signatureError = signatureError
        }
    }

    /// The outcomes in request order.
    public var offers: [Offer]

    /// The error code for "no In-App Purchase key for this app".
    public static let noKeyCode = 7234
    /// The error code for an offer entry that cannot be signed as sent (a
    /// field missing or breaking a field rule): RevenueCat's `badRequest`
    /// backend error code. The message names the field, e.g.
    /// `generate_offers[1].offer_id`.
    public static let invalidOfferCode = 7226

    /// Makes a response.
    public init(offers: [Offer]) {
        self.offers = offers
    }
}

/// `GET /v1/keys` response: what is configured, never a secret.
public struct KeysResponse: Codable, Sendable, Equatable {
    /// One configured key.
    public struct Key: Codable, Sendable, Equatable {
        /// The 10-character key ID (`key_id`).
        public var keyID: String
        /// The issuer ID the JWS kinds use (`issuer_id`): the key's own, else the
        /// top-level one; `null` when neither is configured.
        public var issuerID: String?
        /// The bundle IDs the key may sign for (`bundle_ids`).
        public var bundleIDs: [String]
        /// The key's curve (`curve`): always `P-256`.
        public var curve: String
        /// PEM SubjectPublicKeyInfo (`public_key_pem`); `null` when it cannot
        /// be read (the key is not on the token, or the token is down).
        public var publicKeyPEM: String?
        /// The label of the token the key is on (`token_label`).
        public var tokenLabel: String

        enum CodingKeys: String, CodingKey {
            case keyID = "key_id", issuerID = "issuer_id", bundleIDs = "bundle_ids", curve
            case publicKeyPEM = "public_key_pem", tokenLabel = "token_label"
        }

        /// Writes every member the contract lists (API contract v1, `GET
        /// /v1/keys`), `null` for an unknown issuer ID or public key, so a
        /// strict client finds each member present.
        /// - Parameter encoder: the encoder to write to.
        /// - Throws: what `encoder` throws.
        public func encode(to encoder: any Encoder) throws {
            var container = encoder.container(keyedBy: CodingKeys.self)
            try container.encode(keyID, forKey: .keyID)
            try container.encode(issuerID, forKey: .issuerID)
            try container.encode(bundleIDs, forKey: .bundleIDs)
            try container.encode(curve, forKey: .curve)
            try container.encode(publicKeyPEM, forKey: .publicKeyPEM)
            try container.encode(tokenLabel, forKey: .tokenLabel)
        }

        /// Makes a key entry.
        public init(keyID: String, issuerID: String?, bundleIDs: [String], curve: String, publicKeyPEM: String?, tokenLabel: String) {
            self.keyID = keyID
            self.issuerID = issuerID
            self.bundleIDs = bundleIDs
            self.curve = curve
            self.publicKeyPEM = publicKeyPEM
            self.tokenLabel = tokenLabel
        }
    }

    /// The configured keys, in configuration order (`keys`).
    public var keys: [Key]

    /// Makes a response.
    public init(keys: [Key]) {
        self.keys = keys
    }
}

/// `GET /readyz` response (200 ready, 503 not ready).
public struct ReadinessResponse: Codable, Sendable, Equatable {
    /// One key's self-test result.
    public struct Key: Codable, Sendable, Equatable {
        /// The key checked (`key_id`).
        public var keyID: String
        /// Whether the key just signed a test digest that verified.
        public var ok: Bool
        /// When the check ran, UNIX time in milliseconds.
        public var lastCheckMs: Int64
        /// What failed, when `ok` is false.
        public var error: String?

        enum CodingKeys: String, CodingKey {
            case keyID = "key_id", ok, lastCheckMs = "last_check_ms", error
        }

        /// Makes a key result.
        public init(keyID: String, ok: Bool, lastCheckMs: Int64, error: String? = nil) {
            self.keyID = keyID
            self.ok = ok
            self.lastCheckMs = lastCheckMs
            self.error = error
        }
    }

    /// The error object, present when not ready (the contract's error shape).
    public struct ErrorBody: Codable, Sendable, Equatable {
        /// The error code (`code`): `hsm_unavailable`.
        public var code: String
        /// What is not ready (`message`): the same text as ``ReadinessResponse/reason``.
        public var message: String
        /// Makes an error object.
        public init(code: String, message: String) {
            self.code = code
            self.message = message
        }
    }

    /// `ready` or `not_ready`.
    public var status: String
    /// The failing part when not ready (token missing, not logged in, key missing, signature did not verify).
    public var reason: String?
    /// Each configured key's result, in configuration order (`keys`).
    public var keys: [Key]
    /// The contract's error object (`error`), present when not ready.
    public var error: ErrorBody?

    /// Makes a response.
    public init(status: String, reason: String? = nil, keys: [Key], error: ErrorBody? = nil) {
        self.status = status
        self.reason = reason
        self.keys = keys
        self.error = error
    }
}

/// The error body of every failed request.
public struct ErrorResponse: Codable, Sendable, Equatable {
    /// The `error` object.
    public struct Body: Codable, Sendable, Equatable {
        /// The stable error code (`code`), one of ``APIError/Code``.
        public var code: String
        /// A sentence naming the field and what was expected (`message`).
        public var message: String
        /// The field at fault (`field`); absent when no single field is.
        public var field: String?
    }

    /// The error object (`error`).
    public var error: Body
}

/// A response body the daemon writes without JSONEncoder (the hot paths:
/// every signing response). Tests decode these bodies with the Codable
/// conformances, so both stay in step.
protocol DirectJSON {
    /// The compact JSON bytes.
    var jsonBytes: [UInt8] { get }
}

/// Builds one compact JSON object member by member, as UTF-8 bytes.
struct JSONObjectWriter {
    private var buffer: [UInt8]
    private var first = true

    init() {
        buffer = [UInt8(ascii: "{")]
        buffer.reserveCapacity(256)  // a signing response fits; growing costs copies
    }

    private mutating func key(_ name: StaticString) {
        if !first { buffer.append(UInt8(ascii: ",")) }
        first = false
        buffer.append(UInt8(ascii: "\""))
        name.withUTF8Buffer { buffer.append(contentsOf: $0) }  // member names are plain ASCII
        buffer.append(contentsOf: [UInt8(ascii: "\""), UInt8(ascii: ":")])
    }

    mutating func add(_ name: StaticString, _ value: String) {
        key(name)
        Logger.appendJSONString(value, to: &buffer)
    }

    mutating func add(_ name: StaticString, _ value: Int64) {
        key(name)
        buffer.append(contentsOf: String(value).utf8)
    }

    mutating func add(_ name: StaticString, raw json: [UInt8]) {
        key(name)
        buffer.append(contentsOf: json)
    }

    /// The object, closed: the writer's last use.
    consuming func bytes() -> [UInt8] {
        buffer.append(UInt8(ascii: "}"))
        return buffer
    }
}

extension PromotionalOfferResponse: DirectJSON {
    var jsonBytes: [UInt8] {
        var writer = JSONObjectWriter()
        writer.add("app_account_token", appAccountToken)
        writer.add("key_id", keyID)
        writer.add("nonce", nonce)
        writer.add("timestamp", timestamp)
        writer.add("signature", signature)
        return writer.bytes()
    }
}

extension JWSResponse: DirectJSON {
    var jsonBytes: [UInt8] {
        var writer = JSONObjectWriter()
        writer.add("jws", jws)
        writer.add("key_id", keyID)
        writer.add("nonce", nonce)
        return writer.bytes()
    }
}

extension ServerAPITokenResponse: DirectJSON {
    var jsonBytes: [UInt8] {
        var writer = JSONObjectWriter()
        writer.add("token", token)
        writer.add("key_id", keyID)
        writer.add("issued_at", issuedAt)
        writer.add("expires_at", expiresAt)
        return writer.bytes()
    }
}

extension OffersResponse: DirectJSON {
    var jsonBytes: [UInt8] {
        var out = Array(#"{"offers":["#.utf8)
        for (index, offer) in offers.enumerated() {
            if index > 0 { out.append(UInt8(ascii: ",")) }
            var writer = JSONObjectWriter()
            if let keyID = offer.keyID { writer.add("key_id", keyID) }
            writer.add("offer_id", offer.offerID)
            writer.add("product_id", offer.productID)
            if let data = offer.signatureData {
                var inner = JSONObjectWriter()
                inner.add("nonce", data.nonce)
                inner.add("signature", data.signature)
                inner.add("timestamp", data.timestamp)
                writer.add("signature_data", raw: inner.bytes())
            }
            if let error = offer.signatureError {
                var inner = JSONObjectWriter()
                inner.add("code", Int64(error.code))
                inner.add("message", error.message)
                writer.add("signature_error", raw: inner.bytes())
            }
            out.append(contentsOf: writer.bytes())
        }
        out.append(contentsOf: "]}".utf8)
        return out
    }
}

/// Encodes wire values as compact JSON with the contract's key order kept stable (sorted).
enum WireJSON {
    static func encode(_ value: some Encodable) -> [UInt8] {
        if let direct = value as? any DirectJSON {
            return direct.jsonBytes
        }
        let encoder = JSONEncoder()
        encoder.outputFormatting = [.sortedKeys, .withoutEscapingSlashes]
        // Encoding these value types cannot fail: no floats that are NaN, no custom throwing encoders.
        return Array((try? encoder.encode(value)) ?? Data("{}".utf8))
    }
}

/// `POST /v1/sign/promotional-offer-v2` request (StoreKit 2 `Product.PurchaseOption.promotionalOffer(_:compactJWS:)`).
public struct PromotionalOfferV2Request: Codable, Sendable, Equatable {
    /// The member names the request body may carry (built once, not per request).
    static let fields: Set<String> = ["bundle_id", "key_id", "product_id", "offer_id", "transaction_id"]

    /// The app's bundle ID (`bundle_id`, required): the `bid` claim.
    public var bundleID: String
    /// The key ID (`key_id`); optional when exactly one key (or the default key) serves the bundle.
    public var keyID: String?
    /// The subscription's product identifier (`product_id`, required): the `productId` claim.
    public var productID: String
    /// The promotional offer identifier (`offer_id`, required): the `offerIdentifier` claim.
    public var offerID: String
    /// Optional: the customer's original or current transaction ID, digits.
    public var transactionID: String?

    enum CodingKeys: String, CodingKey {
        case bundleID = "bundle_id", keyID = "key_id", productID = "product_id", offerID = "offer_id", transactionID = "transaction_id"
    }

    /// Makes a request.
    public init(bundleID: String, keyID: String? = nil, productID: String, offerID: String, transactionID: String? = nil) {
        self.bundleID = bundleID
        self.keyID = keyID
        self.productID = productID
        self.offerID = offerID
        self.transactionID = transactionID
    }

    /// Parses a request body.
    /// - Throws: ``APIError`` naming the field.
    public init(body: [UInt8]) throws(APIError) {
        var reader = try FieldReader(json: body, allowed: Self.fields)
        bundleID = try reader.string("bundle_id", "the app's bundle ID")
        keyID = try reader.optionalString("key_id")
        productID = try reader.string("product_id", "the subscription's product identifier")
        offerID = try reader.string("offer_id", "the promotional offer identifier")
        transactionID = try reader.optionalString("transaction_id")
        try reader.finish()
    }
}

/// `POST /v1/sign/introductory-offer-eligibility` request.
public struct IntroductoryOfferEligibilityRequest: Codable, Sendable, Equatable {
    /// The member names the request body may carry (built once, not per request).
    static let fields: Set<String> = ["bundle_id", "key_id", "product_id", "allow_introductory_offer", "transaction_id"]

    /// The app's bundle ID (`bundle_id`, required): the `bid` claim.
    public var bundleID: String
    /// The key ID (`key_id`); optional when exactly one key (or the default key) serves the bundle.
    public var keyID: String?
    /// The subscription's product identifier (`product_id`, required): the `productId` claim.
    public var productID: String
    /// Whether the customer may get the introductory offer (a JSON boolean).
    public var allowIntroductoryOffer: Bool
    /// Required: the customer's transaction ID, digits.
    public var transactionID: String

    enum CodingKeys: String, CodingKey {
        case bundleID = "bundle_id", keyID = "key_id", productID = "product_id"
        case allowIntroductoryOffer = "allow_introductory_offer", transactionID = "transaction_id"
    }

    /// Makes a request.
    public init(bundleID: String, keyID: String? = nil, productID: String, allowIntroductoryOffer: Bool, transactionID: String) {
        self.bundleID = bundleID
        self.keyID = keyID
        self.productID = productID
        self.allowIntroductoryOffer = allowIntroductoryOffer
        self.transactionID = transactionID
    }

    /// Parses a request body.
    /// - Throws: ``APIError`` naming the field (`missing_field` for `transaction_id`).
    public init(body: [UInt8]) throws(APIError) {
        var reader = try FieldReader(json: body, allowed: Self.fields)
        bundleID = try reader.string("bundle_id", "the app's bundle ID")
        keyID = try reader.optionalString("key_id")
        productID = try reader.string("product_id", "the subscription's product identifier")
        allowIntroductoryOffer = try reader.bool("allow_introductory_offer")
        transactionID = try reader.string("transaction_id", "the customer's App Store transaction ID (digits)")
        try reader.finish()
    }
}

/// `POST /v1/sign/advanced-commerce-request` request.
public struct AdvancedCommerceSigningRequest: Codable, Sendable, Equatable {
    /// The member names the request body may carry (built once, not per request).
    static let fields: Set<String> = ["bundle_id", "key_id", "request"]

    /// The app's bundle ID (`bundle_id`, required): the `bid` claim.
    public var bundleID: String
    /// The key ID (`key_id`); optional when exactly one key (or the default key) serves the bundle.
    public var keyID: String?
    /// The Advanced Commerce request object; signed as standard Base64 of its compact UTF-8 JSON.
    public var request: [String: JSONValue]

    enum CodingKeys: String, CodingKey {
        case bundleID = "bundle_id", keyID = "key_id", request
    }

    /// Makes a request.
    public init(bundleID: String, keyID: String? = nil, request: [String: JSONValue]) {
        self.bundleID = bundleID
        self.keyID = keyID
        self.request = request
    }

    /// Parses a request body.
    /// - Throws: ``APIError``; `invalid_field` when `request` is not a JSON object.
    public init(body: [UInt8]) throws(APIError) {
        var reader = try FieldReader(json: body, allowed: Self.fields)
        bundleID = try reader.string("bundle_id", "the app's bundle ID")
        keyID = try reader.optionalString("key_id")
        request = try reader.object("request")
        if let path = JSONValue.object(request).firstFractionalNumber(path: "request") {
            throw APIError(.invalidField, "\(path) has a fraction or exponent; numbers in an Advanced Commerce request must be integers (prices are in milliunits), since a fraction could be signed as another value", field: path)
        }
        try reader.finish()
    }
}

/// `POST /v1/tokens/app-store-server-api` request.
public struct ServerAPITokenRequest: Codable, Sendable, Equatable {
    /// The member names the request body may carry (built once, not per request).
    static let fields: Set<String> = ["bundle_id", "key_id", "ttl_seconds"]
    /// The range of `ttl_seconds`, in the words of its error.
    static let ttlRange = "1 to 3600 seconds (Apple refuses tokens that live longer than an hour)"

    /// The app's bundle ID (`bundle_id`, required): the `bid` claim.
    public var bundleID: String
    /// The key ID (`key_id`); optional when exactly one key (or the default key) serves the bundle.
    public var keyID: String?
    /// Token life in seconds, 1–3600. Default 300.
    public var ttlSeconds: Int?

    enum CodingKeys: String, CodingKey {
        case bundleID = "bundle_id", keyID = "key_id", ttlSeconds = "ttl_seconds"
    }

    /// Makes a request.
    public init(bundleID: String, keyID: String? = nil, ttlSeconds: Int? = nil) {
        self.bundleID = bundleID
        self.keyID = keyID
        self.ttlSeconds = ttlSeconds
    }

    /// Parses a request body.
    /// - Throws: ``APIError``; `invalid_field` for `ttl_seconds` outside 1–3600.
    public init(body: [UInt8]) throws(APIError) {
        var reader = try FieldReader(json: body, allowed: Self.fields, integerRanges: ["ttl_seconds": Self.ttlRange])
        bundleID = try reader.string("bundle_id", "the app's bundle ID")
        keyID = try reader.optionalString("key_id")
        if let ttl = try reader.optionalInteger("ttl_seconds", "seconds") {
            guard (1...3600).contains(ttl) else {
                throw APIError(.invalidField, "ttl_seconds must be \(Self.ttlRange); got \(ttl)", field: "ttl_seconds")
            }
            ttlSeconds = Int(ttl)
        } else {
            ttlSeconds = nil
        }
        try reader.finish()
    }
}

/// Response of the three StoreKit JWS endpoints.
public struct JWSResponse: Codable, Sendable, Equatable {
    /// The compact JWS.
    public var jws: String
    /// The key that signed (the header's `kid`).
    public var keyID: String
    /// The `nonce` claim (lowercase UUID v4).
    public var nonce: String

    enum CodingKeys: String, CodingKey {
        case jws, keyID = "key_id", nonce
    }

    /// Makes a response.
    public init(jws: String, keyID: String, nonce: String) {
        self.jws = jws
        self.keyID = keyID
        self.nonce = nonce
    }
}

/// Response of `POST /v1/tokens/app-store-server-api`.
public struct ServerAPITokenResponse: Codable, Sendable, Equatable {
    /// The bearer token (compact JWS) for `Authorization: Bearer …`.
    public var token: String
    /// The key that signed (`key_id`): the header's `kid`.
    public var keyID: String
    /// `iat`, UNIX seconds.
    public var issuedAt: Int64
    /// `exp`, UNIX seconds.
    public var expiresAt: Int64

    enum CodingKeys: String, CodingKey {
        case token, keyID = "key_id", issuedAt = "issued_at", expiresAt = "expires_at"
    }

    /// Makes a response.
    public init(token: String, keyID: String, issuedAt: Int64, expiresAt: Int64) {
        self.token = token
        self.keyID = keyID
        self.issuedAt = issuedAt
        self.expiresAt = expiresAt
    }
}
